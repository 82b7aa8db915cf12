"""Generated protocol stubs (specmesh.proto.v1). The only place in specmesh/ that may import grpc."""
