"""One unary call with gRPC C-core (Python grpcio) with the :authority the kubelet's plugin
watcher sends: grpc-go dials the raw socket path with no authority override and so sends the
path percent-encoded ('/' as %2F). Debian's grpcio 1.51 would send "localhost" for a unix:
target, so the authority is set to what grpc-go sends (grpc.default_authority). Raw bytes in
and out, so no generated code is needed.

usage: grpc_c_core_call.py SOCKET METHOD_PATH REQUEST_HEX
prints "ok <answer hex>" or "error <CODE> <details>"."""
import sys
import urllib.parse

try:
    import grpc
except ImportError:
    print("missing: python3-grpcio (apt-get install python3-grpcio)")
    sys.exit(3)

socket, method, request = sys.argv[1:4]
authority = urllib.parse.quote(socket, safe="")
options = [("grpc.default_authority", authority)]
with grpc.insecure_channel("unix:" + socket, options=options) as channel:
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    try:
        answer = call(bytes.fromhex(request), timeout=5)
        print("ok", answer.hex())
    except grpc.RpcError as e:
        print("error", e.code().name, e.details())
