"""jaxoverlap.server: the gRPC serving front end (server, client, benchmark) around one Engine.

Modules: engine_worker (the engine on its own thread), grpc_server (the grpc.aio service),
client (sync and asyncio clients), bench (load generator), metrics (Prometheus), cli_commands
(what the `jaxoverlap serve|client|bench` subcommands call), gen_proto (regenerates the
jaxoverlap_pb2* bindings from proto/jaxoverlap/v1/jaxoverlap.proto).
Nothing is imported here, so `import jaxoverlap.server.client` does not pull in the engine.
"""
