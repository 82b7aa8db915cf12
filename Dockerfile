# One image for every specmesh service; the module to run is the container's argument.
#
#   docker build -t specmesh:cpu .                                   # CPU torch (default)
#   docker build -t specmesh:cuda --build-arg TORCH_INDEX=cu128 .    # CUDA torch; the driver comes from the node
#   docker run --rm -p 50052:50052 -v specmesh-cache:/var/cache/specmesh specmesh:cpu target_service --host 0.0.0.0
#   docker run --rm specmesh:cpu client.cli --help                   # the `specmesh` CLI
#
# No model is baked in: the services fetch / convert their model at start into $SPECMESH_HOME
# (/var/cache/specmesh), so mount a volume there (Kubernetes: a PVC or an emptyDir, deploy/k8s/).
# The default model is fetched with pip at first start: the pod needs egress to PyPI, or a cache
# volume filled beforehand (`python -m specmesh.models.resolve default` with the same SPECMESH_HOME).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# torch is installed first, pinned, from the PyTorch index of the variant: cpu | cu126 | cu128 | ...
# (a loose torch requirement resolved by `pip install .` would pull another build)
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_INDEX}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv \
 && pip install --upgrade pip \
 && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos protos
COPY specmesh specmesh
COPY servicekit servicekit
COPY draft_service draft_service
COPY target_service target_service
COPY stage_service stage_service
COPY coordinator coordinator
COPY gateway gateway
COPY client client
COPY configs configs
# stubs regenerated from protos/ as `make proto` does (same pinned generator versions as the test extra),
# then the package installed in place (as `make install` does; the low-bit kernel's C++ source stays beside it)
RUN pip install "grpcio-tools==1.85.1" "mypy-protobuf==5.1.0" \
 && python protos/generate.py \
 && pip uninstall --yes grpcio-tools mypy-protobuf \
 && pip install -e ".[gateway]" \
 && find /app -name __pycache__ -prune -exec rm -rf {} +

FROM ${PYTHON_IMAGE}
# g++: the low-bit CPU kernel is compiled at first use for the node's CPU (cached under $SPECMESH_HOME);
# LOWBIT_KERNEL=0 leaves it out and the services fall back to torch for those layers
ARG LOWBIT_KERNEL=1
ARG UID=10001
RUN if [ "${LOWBIT_KERNEL}" = "1" ]; then \
      apt-get update && apt-get install --yes --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*; \
    fi \
 && groupadd --system --gid "${UID}" specmesh \
 && useradd --system --uid "${UID}" --gid "${UID}" --home-dir /home/specmesh --create-home specmesh \
 && mkdir -p /var/cache/specmesh \
 && chown "${UID}:${UID}" /var/cache/specmesh
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
ENV PATH=/opt/venv/bin:$PATH \
    SPECMESH_HOME=/var/cache/specmesh \
    HF_HOME=/var/cache/specmesh/huggingface \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /app
USER ${UID}:${UID}
VOLUME ["/var/cache/specmesh"]
# gRPC: coordinator 50050, draft 50051, verify 50052, stage 50053; gateway HTTP 8000; metrics as configured
EXPOSE 50050 50051 50052 50053 8000 9090
ENTRYPOINT ["python", "-m"]
CMD ["client.cli", "--help"]
