"""Serving through FastDeploy (Paddle's GPU inference server) when it is installed and a GPU is present.

FastDeploy speaks the same OpenAI API as our Paddle server, so ``ernie-studio serve`` chooses the backend,
checks that the installed FastDeploy accepts every flag of the launch plan (its ``--help``), writes the model
in the form FastDeploy loads (``engine.train.serving_export.export_for_serving``), launches
``python -m fastdeploy.entrypoints.openai.api_server`` on ports reserved for this deployment, waits for its
/health, keeps its logs in a file, records every process it starts, and stops them all.

The flags are those of the pinned release (``FASTDEPLOY_RELEASE``): FastDeploy's own argument parser is
``fastdeploy/entrypoints/openai/api_server.py`` (ports, host) plus ``EngineArgs.add_cli_args`` in
``fastdeploy/engine/args_utils.py`` (everything else).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from engine.serve.fastdeploy_env import (
    _separate,
    fastdeploy_importable,
    fastdeploy_python,
    fastdeploy_version,
    gpu_present,
)
from engine.serve.ports import PortReservation, Ports, reserve_ports
from engine.serve.process_records import kill_recorded, record_processes, recorded_alive, wait_gone

log = logging.getLogger(__name__)

# The release the Docker image and the docs pin (docker/Dockerfile.serve, docs/deploy.md). 2.0.0 lacked
# --served-model-name (and with it /v1/models under our name), which `ernie-studio chat` asks first.
FASTDEPLOY_RELEASE = "2.3.0"
FASTDEPLOY_IMAGE = (
    f"ccr-2vdh3abv-pub.cnc.bj.baidubce.com/paddlepaddle/fastdeploy-cuda-12.6:{FASTDEPLOY_RELEASE}"
)
FASTDEPLOY_WHEEL_INDEX = "https://www.paddlepaddle.org.cn/packages/stable/fastdeploy-gpu-80_90/"
API_SERVER_MODULE = "fastdeploy.entrypoints.openai.api_server"

# FastDeploy's defaults for these (args_utils.py: block_size 64, kv_cache_ratio 0.75); passed explicitly so
# the plan says what the server runs with. GPU memory: FastDeploy takes 0.9 of the device by default, so
# deployments sharing a GPU must each be given their share (see `gpu_share`).
BLOCK_SIZE = 64
# --max-model-len when `ernie-studio serve` is given none (the studio's deployments give none).
DEFAULT_MAX_MODEL_LEN = 32768
KV_CACHE_RATIO = 0.75
GPU_MEMORY_UTILIZATION = 0.9
QUANTIZATIONS = ("wint4", "wint8", "block_wise_fp8")

LORA_MARKERS = (
    "adapter_config.json",
    "lora_config.json",
    "adapter_model.safetensors",
    "lora_model.safetensors",
)
PIDS_FILE = "fastdeploy.pids.json"


# ---- does the installed FastDeploy take our flags? ------------------------------------------------------


@dataclass
class FlagCheck:
    """The installed FastDeploy's --help against the flags the launcher passes."""

    ok: bool
    version: str | None
    missing: list[str] = field(default_factory=list)
    message: str = ""


def help_flags(help_text: str) -> set[str]:
    """Every ``--long-flag`` an argparse ``--help`` lists."""
    return set(re.findall(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)", help_text))


def plan_flags(argv: list[str]) -> list[str]:
    """The ``--flags`` of a command line, in order, once each."""
    return list(dict.fromkeys(a for a in argv if a.startswith("--")))


def launcher_flags() -> list[str]:
    """Every flag any launch plan may pass (text, VL, quantized, tensor parallel)."""
    probe = LaunchPlanArgs(
        model_dir=Path("."), port=0, is_vl=True, quantization="wint8", tensor_parallel_size=2
    )
    return plan_flags(build_argv(probe, python="python", ports=Ports(0, 0, 0, 0)))


def check_flags(help_text: str, version: str | None, flags: list[str] | None = None) -> FlagCheck:
    """Refuse when the --help lacks a flag the launcher passes, naming it and the version found."""
    accepted = help_flags(help_text)
    missing = [f for f in (flags or launcher_flags()) if f not in accepted]
    if not missing:
        return FlagCheck(True, version, [], f"FastDeploy {version or '(version unknown)'} takes every flag")
    found = f"FastDeploy {version}" if version else "the installed FastDeploy (version unknown)"
    return FlagCheck(
        False,
        version,
        missing,
        f"{found} does not accept {', '.join(missing)}, which the launcher passes; install FastDeploy "
        f"{FASTDEPLOY_RELEASE} (image {FASTDEPLOY_IMAGE}, or `pip install fastdeploy-gpu=={FASTDEPLOY_RELEASE} "
        f"-i {FASTDEPLOY_WHEEL_INDEX}`) or serve with --backend paddle",
    )


def check_installed(python: str | None = None, timeout: float = 180.0) -> FlagCheck:
    """Run the installed api_server's ``--help`` in FastDeploy's Python (it parses its arguments at import,
    before any engine starts) and check the launcher's flags against it."""
    python = python or fastdeploy_python()
    version = fastdeploy_version()
    try:
        out = subprocess.run(
            [python, "-m", API_SERVER_MODULE, "--help"],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return FlagCheck(False, version, [], f"`{API_SERVER_MODULE} --help` did not run: {e}")
    if out.returncode != 0 or "--model" not in out.stdout:
        tail = (out.stderr or out.stdout)[-600:].strip()
        return FlagCheck(
            False, version, [], f"`{API_SERVER_MODULE} --help` failed (exit code {out.returncode}): {tail}"
        )
    return check_flags(out.stdout, version)


@functools.cache
def installed_check() -> FlagCheck:
    """`check_installed` once per process (serving workers ask before every FastDeploy deployment)."""
    return check_installed()


def lora_adapter_files(model_dir: str | Path) -> list[str]:
    """LoRA adapter files in a directory (a LoRA run dir that has not been merged into full weights)."""
    d = Path(model_dir)
    found = [name for name in LORA_MARKERS if (d / name).exists()]
    summary = d / "run_summary.json"
    if not found and summary.exists():
        try:
            info = json.loads(summary.read_text())
        except json.JSONDecodeError:
            info = {}
        if str(info.get("fine_tuning", "")).lower() == "lora" and not (d / "config.json").exists():
            found.append("run_summary.json (fine_tuning: LoRA)")
    return found


def merge_hint(model_dir: str | Path) -> str:
    return (
        f"merge the adapter into full weights first: `ernie-studio export <the run's config.yaml> lora=True` "
        f"writes <output_dir>/export, then serve that directory (the Paddle backend can serve {model_dir} "
        f"directly with --backend paddle)"
    )


def choose_backend(
    requested: str,
    model_dir: str | Path,
    *,
    importable: bool | None = None,
    gpu: bool | None = None,
    flags: FlagCheck | None = None,
) -> tuple[str, str]:
    """(backend, reason): ``auto`` takes FastDeploy only with FastDeploy installed, taking our flags, a GPU
    and full weights; ``flags`` is the --help check (run here when FastDeploy and a GPU are present)."""
    if requested not in ("auto", "paddle", "fastdeploy"):
        raise ValueError(f"--backend must be auto, paddle or fastdeploy, not {requested!r}")
    if requested == "paddle":
        return "paddle", "requested"
    short, long = _fastdeploy_unusable(model_dir, importable, gpu, flags)
    if requested == "fastdeploy":
        if long:
            raise ValueError(f"--backend fastdeploy: {long}")
        return "fastdeploy", "requested"
    if short:
        return "paddle", short
    return "fastdeploy", "FastDeploy is installed and a GPU is present"


def model_unsupported(model_dir: str | Path | None) -> str:
    """Why the studio does not hand ``model_dir`` to FastDeploy ('' when it does). FastDeploy's own source
    serves PaddleOCR-VL (docs/deploy.md), but this launch plan (``export_for_serving``, the chat fields) is
    checked for ERNIE 4.5 models only."""
    from engine.models.paddleocr_vl_config import is_paddleocr_vl_dir
    from engine.models.paths import architecture_dir

    if model_dir is None or not Path(model_dir).is_dir():
        return ""
    try:
        ocr = is_paddleocr_vl_dir(architecture_dir(model_dir))  # a LoRA run: its base's
    except FileNotFoundError:
        return ""
    if ocr:
        return (
            "a PaddleOCR-VL model: the studio's FastDeploy launch plan is checked for ERNIE 4.5 models only; "
            "the built-in Paddle server serves it (backend paddle)"
        )
    return ""


def _fastdeploy_unusable(
    model_dir: str | Path, importable: bool | None, gpu: bool | None, flags: FlagCheck | None
) -> tuple[str, str]:
    """Why FastDeploy cannot serve ``model_dir`` here: (the reason `auto` gives, the error for an explicit
    request); empty strings when it can. The --help check runs last, only when the rest holds."""
    unsupported = model_unsupported(model_dir)
    if unsupported:
        return unsupported, f"{model_dir} is {unsupported}"
    if not (fastdeploy_importable() if importable is None else importable):
        return "FastDeploy is not installed", (
            "FastDeploy is not installed; install `fastdeploy-gpu` from Paddle's package index (it needs "
            "paddlepaddle-gpu 3.x and CUDA >= 12.3) or use --backend paddle"
        )
    if not (gpu_present() if gpu is None else gpu):
        return (
            "no CUDA GPU is visible",
            "no CUDA GPU is visible; FastDeploy has no CPU build, use --backend paddle",
        )
    lora = lora_adapter_files(model_dir)
    if lora:
        return (
            f"LoRA run dir ({', '.join(lora)}); FastDeploy serves merged weights only",
            f"{model_dir} is a LoRA run ({', '.join(lora)}); {merge_hint(model_dir)}",
        )
    flags = flags or installed_check()
    if not flags.ok:
        return flags.message, flags.message
    return "", ""


def gpu_share(per_gpu: int) -> float:
    """The GPU memory fraction each of ``per_gpu`` FastDeploy deployments sharing one GPU may take."""
    return round(GPU_MEMORY_UTILIZATION / max(1, per_gpu), 2)


# ---- the launch plan -------------------------------------------------------------------------------------


@dataclass
class LaunchPlanArgs:
    """What a FastDeploy launch is made of, before ports are chosen."""

    model_dir: Path
    port: int
    host: str = "127.0.0.1"
    served_model_name: str = "default"
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    max_num_seqs: int = 32
    quantization: str | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    block_size: int = BLOCK_SIZE
    kv_cache_ratio: float = KV_CACHE_RATIO
    is_vl: bool = False


def build_argv(args: LaunchPlanArgs, python: str, ports: Ports) -> list[str]:
    """The api_server command line (flags of args_utils.py / api_server.py of FASTDEPLOY_RELEASE)."""
    argv = [
        python, "-m", API_SERVER_MODULE,
        "--model", str(args.model_dir),
        "--host", args.host,
        "--port", str(ports.api),
        "--metrics-port", str(ports.metrics),
        "--engine-worker-queue-port", str(ports.engine_worker_queue),
        "--cache-queue-port", str(ports.cache_queue),
        "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.max_num_seqs),
        "--served-model-name", args.served_model_name,
        "--gpu-memory-utilization", f"{args.gpu_memory_utilization:g}",
        "--block-size", str(args.block_size),
        "--kv-cache-ratio", f"{args.kv_cache_ratio:g}",
    ]  # fmt: skip
    if args.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.quantization:
        argv += ["--quantization", args.quantization]
    if args.is_vl:
        argv += ["--limit-mm-per-prompt", json.dumps(VL_LIMITS)]
    return argv


@dataclass
class LaunchPlan:
    """Everything needed to start FastDeploy: argv, environment additions, ports and the log file."""

    argv: list[str]
    env: dict[str, str]
    port: int
    metrics_port: int
    engine_worker_queue_port: int
    log_dir: Path
    log_file: Path
    host: str = "127.0.0.1"
    cache_queue_port: int = 0
    reservation: PortReservation | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def pids_file(self) -> Path:
        """Every process the server started, recorded while it runs (see `record_processes`)."""
        return self.log_dir / PIDS_FILE


def plan_launch(
    model_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8188,
    served_model_name: str = "default",
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    max_num_seqs: int = 32,
    quantization: str | None = None,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
    devices: str | None = None,
    log_dir: str | Path | None = None,
    python: str | None = None,
    port_registry_dir: Path | None = None,
) -> LaunchPlan:
    """Build the FastDeploy command line on ``port`` with three more reserved ports (metrics, engine worker
    queue, cache queue); ``devices`` pins it to those GPUs (CUDA_VISIBLE_DEVICES)."""
    model_dir = Path(model_dir).resolve()
    lora = lora_adapter_files(model_dir)
    if lora:
        raise ValueError(
            f"FastDeploy cannot serve the LoRA run {model_dir} ({', '.join(lora)}); {merge_hint(model_dir)}"
        )
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"{model_dir}: no config.json; pass a model directory to --model")
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"--quantization must be {', '.join(QUANTIZATIONS)}, not {quantization!r}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], not {gpu_memory_utilization}")
    args = LaunchPlanArgs(
        model_dir=model_dir,
        port=port,
        host=host,
        served_model_name=served_model_name,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        quantization=quantization,
        tensor_parallel_size=tensor_parallel_size,
        gpu_memory_utilization=gpu_memory_utilization,
        is_vl=is_vl_model(model_dir),
    )
    ports, reservation = reserve_ports(host, port, port_registry_dir)
    log_dir = Path(log_dir) if log_dir else model_dir / "fastdeploy-logs"
    # FD_LOG_DIR keeps FastDeploy's own log/ directory next to our captured stdout instead of the cwd.
    env = {"FD_LOG_DIR": str(log_dir / "log"), "PYTHONUNBUFFERED": "1"}
    python = python or fastdeploy_python()
    if _separate(python):
        # FastDeploy's own helpers found on PATH come from its environment, not the studio's
        bin_dir = str(Path(python).resolve().parent)
        env["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = devices
    return LaunchPlan(
        build_argv(args, python, ports),
        env,
        ports.api,
        ports.metrics,
        ports.engine_worker_queue,
        log_dir,
        log_dir / "server.log",
        host,
        ports.cache_queue,
        reservation,
    )


# How many images / videos one prompt may hold (JSON, --limit-mm-per-prompt, as FastDeploy's ERNIE 4.5 VL
# guide passes it). FastDeploy detects multimodal models from config.json itself (--enable-mm is deprecated).
# No --reasoning-parser: `ernie-45-vl` needs a `</think>` token in the tokenizer and, streaming, sends
# everything before `</think>` as `reasoning_content`, which the studio's chats (reading `content`, as the
# Paddle server sends it) would not show.
VL_LIMITS = {"image": 10, "video": 3}


def is_vl_model(model_dir: Path) -> bool:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return "vision_config" in config


def vl_flags(model_dir: Path) -> list[str]:
    """FastDeploy's flags for an ERNIE 4.5 VL model directory (none for text models)."""
    return ["--limit-mm-per-prompt", json.dumps(VL_LIMITS)] if is_vl_model(model_dir) else []


# ---- chat requests in the form FastDeploy takes ------------------------------------------------------------
# FastDeploy's ChatCompletionRequest has no `ignore_eos` (pydantic drops it unread): `min_tokens` keeps EOS away.
# Its engine refuses a request whose prompt + min_tokens >= max_model_len (a 400), and its ERNIE 4.5 VL processor
# renders with enable_thinking=True unless the request's chat_template_kwargs say otherwise, its runner then
# forcing `</think>` into the answer when the vocabulary has that token.
THINK_END_TOKEN = "</think>"
# Tokens counted for each image on top of its largest grid: "Picture N:" and the start / end marks.
IMAGE_MARK_TOKENS = 8


def fit_chat_request(
    body: dict, *, prompt_tokens: int, max_model_len: int = DEFAULT_MAX_MODEL_LEN, is_vl: bool = False
) -> dict:
    """``body`` (an OpenAI chat request) with the fields FastDeploy reads: ``ignore_eos`` as ``min_tokens`` of
    the completion limit (``max_completion_tokens`` or ``max_tokens``), ``min_tokens`` capped below
    ``max_model_len`` - ``prompt_tokens``, and for a VL model thinking off unless the request turns it on."""
    out = dict(body)
    limit = out.get("max_completion_tokens") or out.get("max_tokens")
    if out.get("ignore_eos") and limit:
        out["min_tokens"] = int(limit)
    if out.get("min_tokens"):
        room = max_model_len - prompt_tokens - 1
        if room >= 1:
            out["min_tokens"] = min(int(out["min_tokens"]), room)
        else:  # the prompt alone fills the context: FastDeploy's own length error says so
            out.pop("min_tokens")
    if is_vl:
        kwargs = dict(out.get("chat_template_kwargs") or {})
        kwargs.setdefault("enable_thinking", False)
        out["chat_template_kwargs"] = kwargs
    return out


@functools.lru_cache(maxsize=8)
def _tokenizer(directory: str):
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(directory)


def thinks(tokenizer_dir: str | Path) -> bool:
    """Whether the model's vocabulary holds ``</think>`` (FastDeploy then forces it into thinking replies)."""
    tok = _tokenizer(str(Path(tokenizer_dir).resolve()))
    return THINK_END_TOKEN in tok.added_tokens or tok.sp.piece_to_id(THINK_END_TOKEN) != tok.sp.unk_id()


def prompt_tokens(tokenizer_dir: str | Path, messages: list[dict]) -> int:
    """An upper bound of the prompt FastDeploy makes of ``messages``: the text through the model's chat
    template, each image at its largest grid (the processor's max_pixels) plus its marks."""
    from engine.data.vl_processor import ProcessorSettings

    d = Path(tokenizer_dir).resolve()
    tok = _tokenizer(str(d))
    images = 0
    flat = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = [p for p in content if isinstance(p, dict)]
            images += sum(p.get("type") in ("image", "image_url") for p in parts)
            content = "".join(str(p.get("text", "")) for p in parts if p.get("type") == "text")
        flat.append({"role": m.get("role"), "content": content or ""})
    count = len(tok.apply_chat_template(flat, add_generation_prompt=True, tokenize=True))
    if images:
        settings = ProcessorSettings.from_model_dir(d)
        count += images * (settings.max_pixels // settings.factor**2 + IMAGE_MARK_TOKENS)
    return count


PR_SET_PDEATHSIG = 1


def _api_server_setup() -> None:
    """preexec_fn: the api_server gets SIGTERM when the process that started it dies, so FastDeploy's own
    shutdown (which ends its workers) runs even when `ernie-studio serve` is SIGKILLed with its worker."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class FastDeployServer:
    """A running FastDeploy api_server in its own session, with every process it starts recorded."""

    RECORD_EVERY_S = 1.0

    def __init__(self, plan: LaunchPlan):
        self.plan = plan
        self.proc: subprocess.Popen | None = None
        self._log = None
        self._recording = threading.Event()
        self._recorder: threading.Thread | None = None

    def start(self, timeout: float = 900.0) -> FastDeployServer:
        """Start it and wait until /health answers 200 (loading large weights takes minutes)."""
        self.plan.log_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.plan.log_file, "ab")  # noqa: SIM115 (closed in stop)
        log.info("starting FastDeploy: %s (logs: %s)", " ".join(self.plan.argv), self.plan.log_file)
        self.proc = subprocess.Popen(
            self.plan.argv,
            env={**os.environ, **self.plan.env},
            cwd=self.plan.log_dir,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_api_server_setup if sys.platform.startswith("linux") else None,
        )
        self._start_recording()
        health = f"http://{_local(self.plan.host)}:{self.plan.port}/health"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()  # its workers may outlive it
                tail = self.plan.log_file.read_text(errors="replace")[-2000:]
                raise RuntimeError(
                    f"FastDeploy exited with code {self.proc.returncode}; last log lines:\n{tail}"
                )
            try:
                with urllib.request.urlopen(health, timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(
            f"FastDeploy did not become healthy within {timeout:.0f}s; see {self.plan.log_file}"
        )

    def _start_recording(self) -> None:
        def loop() -> None:
            while not self._recording.wait(self.RECORD_EVERY_S):
                self._record()

        self._record()
        self._recorder = threading.Thread(target=loop, name="fastdeploy-pids", daemon=True)
        self._recorder.start()

    def _record(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                record_processes(self.plan.pids_file, self.proc.pid)

    def wait(self) -> int:
        return self.proc.wait() if self.proc else 0

    def terminate(self) -> None:
        """SIGTERM to the api_server's process group without waiting (safe in a signal handler); `stop()`
        then reaps it and its recorded workers."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, grace: float = 30.0) -> None:
        """FastDeploy's own shutdown first (SIGTERM to the api_server's group), then SIGKILL to whatever of
        it outlives ``grace``: the group and every recorded process (its setsid workers included)."""
        if self.proc is None:
            return
        self._recording.set()
        if self._recorder is not None and self._recorder is not threading.current_thread():
            self._recorder.join(timeout=5)
        self._record()  # the tree as it is now, before anything leaves it
        pids = self.plan.pids_file
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and not recorded_alive(pids):
                break
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        left = kill_recorded(pids)
        if left:
            log.warning("FastDeploy left %d process(es) after %.0f s; killed %s", len(left), grace, left)
            wait_gone(pids, 10.0)
        self.proc.wait()
        if self.plan.reservation is not None:
            self.plan.reservation.release()
        if self._log:
            self._log.close()
            self._log = None


def _local(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host
