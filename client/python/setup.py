"""Generates the gRPC stubs from proto/relgen/v1/generation.proto while building, so the package
always matches the repository's contract and no generated code is committed. The stubs land in the
`relgen.v1` package (their import path follows the proto's), next to the `relgen_client` wrapper."""
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))
PROTO = os.path.join(PROTO_ROOT, "relgen", "v1", "generation.proto")


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        out = self.build_lib
        protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
        if protoc and plugin:
            # The system's protoc and gRPC plugin: they match the system's runtime packages.
            rc = subprocess.call([protoc, f"-I{PROTO_ROOT}", f"--python_out={out}", f"--grpc_out={out}",
                                  f"--plugin=protoc-gen-grpc={plugin}", PROTO])
        else:
            from grpc_tools import protoc as grpc_protoc

            rc = grpc_protoc.main(["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"--python_out={out}",
                                   f"--grpc_python_out={out}", PROTO])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {PROTO}")
        for pkg in ("relgen", os.path.join("relgen", "v1")):
            open(os.path.join(out, pkg, "__init__.py"), "a").close()


setup(cmdclass={"build_py": BuildWithStubs})
