"""Build hook: generate the gRPC stubs from rota's .proto files.

The stubs land in the built package only (rota_client/_proto), never in
the source tree, so the installed client always matches the contract of
the checkout it was built from.

rota.proto imports "agent.proto" by its bare name, which protoc's Python
generator would turn into a top-level `import agent_pb2`. The files are
therefore compiled from a scratch copy laid out under the package's own
path, with that one import renamed, so the generated modules import each
other as `rota_client._proto.*`.
"""

import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
PROTO_DIR = HERE / "proto"
PACKAGE_PATH = Path("rota_client") / "_proto"
PROTO_FILES = ("rota.proto", "agent.proto")
BARE_IMPORT = 'import "agent.proto";'


def generate_stubs(out_root: Path) -> None:
    """Compile the .proto files into `out_root/rota_client/_proto`."""
    from grpc_tools import protoc  # a build requirement, see pyproject.toml

    missing = [name for name in PROTO_FILES if not (PROTO_DIR / name).is_file()]
    if missing:
        raise RuntimeError(f"rota's .proto files are missing from {PROTO_DIR}: {', '.join(missing)}")
    with tempfile.TemporaryDirectory() as scratch:
        staged = Path(scratch) / PACKAGE_PATH
        staged.mkdir(parents=True)
        for name in PROTO_FILES:
            text = (PROTO_DIR / name).read_text(encoding="utf-8")
            if name == "rota.proto":
                if text.count(BARE_IMPORT) != 1:
                    raise RuntimeError(f"rota.proto: expected one line {BARE_IMPORT!r} to rewrite")
                text = text.replace(BARE_IMPORT, f'import "{PACKAGE_PATH.as_posix()}/agent.proto";')
            (staged / name).write_text(text, encoding="utf-8")
        well_known = Path(protoc.__file__).resolve().parent / "_proto"
        out_root.mkdir(parents=True, exist_ok=True)
        args = [
            "grpc_tools.protoc",
            f"-I{scratch}",
            f"-I{well_known}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
        ] + [(PACKAGE_PATH / name).as_posix() for name in PROTO_FILES]
        if protoc.main(args) != 0:
            raise RuntimeError("grpc_tools.protoc failed on rota's .proto files (see above)")
    init = out_root / PACKAGE_PATH / "__init__.py"
    init.write_text('"""Generated from rota.proto and agent.proto at build time; do not edit."""\n', encoding="utf-8")


class BuildPyWithStubs(build_py):
    """build_py, then the stubs into the build directory."""

    def run(self) -> None:
        super().run()
        generate_stubs(Path(self.build_lib))

    def get_outputs(self, include_bytecode: bool = True) -> list:
        outputs = super().get_outputs(include_bytecode)
        generated = Path(self.build_lib) / PACKAGE_PATH
        if generated.is_dir():
            outputs += [str(path) for path in generated.iterdir() if path.is_file()]
        return outputs


setup(cmdclass={"build_py": BuildPyWithStubs})
