"""The `llamacpp` check: does the llama-server installed on this node take every flag the launcher passes."""

from __future__ import annotations

from engine.doctor.report import Check
from engine.llamacpp import CPU_SERVING_ENV, LLAMA_CPP_PYTHON_VERSION, cpu_serving, find_tool, repack_args
from engine.serve.llamacpp import check_installed


def llamacpp_checks() -> list[Check]:
    """Passes with a note where llama.cpp is not installed on the node (auto then serves CPU deployments with
    the Paddle server); fails, naming the flags, when its --help lacks one we pass; says which engine `auto`
    gives a text model on this CPU node (ERNIE_STUDIO_CPU_SERVING)."""
    server = find_tool("llama-server")
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
    try:
        values["cpu_serving"] = cpu_serving()
    except ValueError as e:
        return [Check("llamacpp", False, str(e), values=values)]
    auto = (
        f"; auto serves text models on CPU with it ({CPU_SERVING_ENV}=paddle keeps the built-in server)"
        if values["cpu_serving"] == "llamacpp"
        else f"; {CPU_SERVING_ENV}=paddle: auto keeps CPU deployments on the built-in server"
    )
    return [Check("llamacpp", True, f"{flags.message} the launcher passes{amx}{auto}", values=values)]
