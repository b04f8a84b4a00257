"""The `llamacpp` check: does the llama-server installed on this node take every flag the launcher passes."""

from __future__ import annotations

from engine.doctor.report import Check
from engine.llamacpp import LLAMA_CPP_PYTHON_VERSION, find_tool, repack_args
from engine.serve.llamacpp import check_installed


def llamacpp_checks() -> list[Check]:
    """Passes with a note where llama.cpp is not installed on the node (auto then serves CPU deployments with
    the Paddle server); fails, naming the flags, when its --help lacks one we pass."""
    server = find_tool("llama-server", node_install=True)
    if server is None:
        return [Check("llamacpp", True, "not installed: CPU deployments use the Paddle server")]
    flags = check_installed(server)
    values = {
        "path": str(server),
        "version": flags.version,
        "pinned": LLAMA_CPP_PYTHON_VERSION,
        "missing": flags.missing,
        "no_repack": bool(repack_args()),
    }
    if not flags.ok:
        return [
            Check("llamacpp", False, f"{flags.message}; llama.cpp deployments are refused", values=values)
        ]
    amx = "; weight repacking is off on this AMX CPU (llama.cpp#20824)" if values["no_repack"] else ""
    return [Check("llamacpp", True, f"{flags.message} the launcher passes{amx}", values=values)]
