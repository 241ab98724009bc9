"""Generated gRPC code for the tiercache.v1 wire contract (scripts/gen_proto.py); do not edit."""
