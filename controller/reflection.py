"""gRPC server reflection under both service names clients ask for.

grpcio-reflection serves ``grpc.reflection.v1alpha.ServerReflection`` only;
current clients (grpcurl, Postman, grpcui) ask for
``grpc.reflection.v1.ServerReflection`` first. The two versions' messages
are the same on the wire (v1 renamed the package and kept every field
number), so the one servicer answers both: v1 requests are parsed with the
v1alpha message classes. The descriptors it serves are the default pool's,
where this project's protos are registered as ``speculation/v1/*.proto``.
"""

from __future__ import annotations

import grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer

V1ALPHA_SERVICE = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name
V1_SERVICE = "grpc.reflection.v1.ServerReflection"


def enable_reflection(server: grpc.aio.Server, service_names: tuple[str, ...]) -> None:
    """Serve reflection v1 and v1alpha on ``server``, listing ``service_names``
    and the two reflection services."""
    servicer = ReflectionServicer((*service_names, V1ALPHA_SERVICE, V1_SERVICE))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE,
                                                                          {"ServerReflectionInfo": handler}),))
