"""Loading a service's model from its options (on the thread that calls it: the service's engine thread)."""

from __future__ import annotations

from servicekit.options import ModelOptions


def resolve_folder(spec: str) -> str:
    """The local HF folder of a model spec (`specmesh.models.resolve` does the resolving)."""
    from specmesh.models.resolve import resolve_model_spec

    return str(resolve_model_spec(spec))


def load_service_engine(options: ModelOptions, model: str | None = None):
    """(engine, resolved folder) for options.model (or `model`) on options.device / dtype."""
    from specmesh.models.engine import measure_step
    from specmesh.models.load import load_engine

    folder = resolve_folder(model or options.model)
    engine = load_engine(folder, backend=options.backend, dtype=options.dtype, device=options.device,
                         max_kv_tokens=options.max_kv_tokens, quantize=options.quantize or None)
    measure_step(engine)  # what a token costs here, reported when sessions open (the callers' k policy prior)
    return engine, folder


def model_shape(spec: str) -> tuple[int, int, str]:
    """(vocab_size, max_context, folder) from the model's config only (no weights): for n-gram drafters."""
    from transformers import AutoConfig

    from specmesh.models.engine import config_max_context

    folder = resolve_folder(spec)
    config = AutoConfig.from_pretrained(folder).get_text_config()
    return int(config.vocab_size), config_max_context(config), folder
