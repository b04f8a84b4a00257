"""`ernie-studio doctor`: the facts and checks of this node, the JSON schema, and floors that fail a node."""

from __future__ import annotations

import json

import paddle
import pytest
from serve_support import fastdeploy_python_stand_in

from engine.cli import main
from engine.doctor import probes
from engine.doctor.report import SCHEMA_VERSION, DoctorFloors, failure_reason
from engine.doctor.runner import run_doctor


@pytest.fixture(scope="module")
def quick_report():
    return run_doctor(full=False, floors=DoctorFloors())


def test_quick_doctor_reports_facts_and_passes_on_a_healthy_node(quick_report):
    report = quick_report.to_dict()
    assert report["schema_version"] == SCHEMA_VERSION and report["passed"] is True and report["full"] is False
    facts = report["facts"]
    assert facts["paddle"]["version"] and isinstance(facts["paddle"]["compiled_with_cuda"], bool)
    assert facts["cpu_count"] >= 1 and facts["memory"]["total_bytes"] > 0
    assert set(facts["fastdeploy"]) == {"available", "version", "python"}
    names = [c["name"] for c in report["checks"]]
    assert (
        names[0] == "devices"
        and "training_probe" in names
        and names[-3:] == ["throughput", "fastdeploy", "llamacpp"]
    )
    for c in report["checks"]:
        assert set(c) >= {"name", "passed", "detail", "duration_s"} and c["passed"], c
    # fleet's stage 1 runs on gloo and NCCL; stage 2 and optimizer offload need a GPU
    sharding = next(c for c in report["checks"] if c["name"] == "sharding")
    assert "stage1" in sharding["values"]["supported"]
    if not report["facts"]["paddle"]["compiled_with_cuda"]:
        assert sharding["values"]["supported"] == ["stage1"] and "stage2 needs a GPU" in sharding["detail"]
    probe = next(c for c in report["checks"] if c["name"] == "training_probe")
    assert probe["values"]["last_loss"] < (1 - probes.MIN_LOSS_DROP) * probe["values"]["first_loss"]
    json.dumps(report)  # one JSON object, nothing unserialisable


def test_the_build_read_from_paddles_version_file_is_what_the_imported_paddle_says():
    """Workers read the node's facts without importing Paddle (`facts.cpu_only_build`), and a doctor that
    imported it must compute the same reuse key: the two readings agree field by field."""
    import paddle

    from engine.doctor.facts import cpu_only_build, imported_paddle_build, paddle_build

    assert cpu_only_build() is (not paddle.device.is_compiled_with_cuda())
    assert paddle_build() == imported_paddle_build()


def test_a_throughput_floor_above_the_node_fails_its_doctor(monkeypatch, capsys):
    monkeypatch.setenv("ERNIE_STUDIO_DOCTOR_MIN_TOKENS_PER_S", "1e12")
    assert main(["doctor", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is False and report["floors"]["min_tokens_per_s"] == 1e12
    failed = [c for c in report["checks"] if not c["passed"]]
    assert [c["name"] for c in failed] == ["throughput"]
    assert "ERNIE_STUDIO_DOCTOR_MIN_TOKENS_PER_S" in failure_reason(report)


def test_device_floor_and_a_cuda_build_without_gpus():
    cpu = {"paddle": {"compiled_with_cuda": False}, "devices": []}
    assert probes.device_check(cpu, DoctorFloors(min_device_memory_gb=80)).passed
    blind = {"paddle": {"compiled_with_cuda": True}, "devices": []}
    assert "sees no GPU" in probes.device_check(blind, DoctorFloors()).detail
    small = {
        "paddle": {"compiled_with_cuda": True},
        "devices": [{"index": 0, "name": "T4", "total_memory_bytes": 16 * 2**30}],
    }
    assert probes.device_check(small, DoctorFloors()).passed
    check = probes.device_check(small, DoctorFloors(min_device_memory_gb=24))
    assert not check.passed and "gpu:0 has 16.0 GiB, below the floor of 24 GiB" in check.detail


def test_the_doctor_runs_every_kernel_self_test_and_a_disagreeing_path_fails_it():
    from engine.models import kernel_self_tests

    checks = probes.fast_path_checks(quick=True)
    assert [c.name for c in checks] == [f"fast_path:{r.name}" for r in kernel_self_tests.self_tests(True)]
    by_name = {c.name: c for c in checks}
    # On this CPU the grouped MoE experts and SwiGLU really run against their plain paths.
    for name in ("fast_path:grouped_moe", "fast_path:swiglu"):
        assert by_name[name].passed and by_name[name].values["ran"]
        assert by_name[name].values["max_abs_diff_fwd"] <= by_name[name].values["tolerance"]
    assert all(c.passed for c in checks)  # a path the device lacks is skipped, not failed
    broken = kernel_self_tests.SelfTestResult("fused_rope", True, False, "forward differs", 0.5, 1e-7, 1e-5)
    check = probes.fast_path_check(broken)
    assert not check.passed and "5.00e-01" in check.detail and "DISABLE_FAST_PATHS=fused_rope" in check.detail


def test_fastdeploy_check_refuses_a_release_missing_a_flag(monkeypatch, tmp_path):
    """The doctor's `fastdeploy` check is the serving worker's --help check: a release lacking a flag of the
    launch plan fails the node's check with the flag and the version; without FastDeploy it passes."""
    from engine.doctor import fastdeploy_probe
    from engine.serve.fastdeploy import FlagCheck, check_flags

    assert fastdeploy_probe.fastdeploy_checks({"fastdeploy": {"available": False}}, None)[0].passed
    python = fastdeploy_python_stand_in(tmp_path / "fd", "", "No broken requirements.", 0)
    monkeypatch.setenv("ERNIE_STUDIO_FASTDEPLOY_PYTHON", str(python))
    old = check_flags("  --model M\n  --port P\n", "2.0.0")
    monkeypatch.setattr(fastdeploy_probe, "check_installed", lambda: old)
    check, _env = fastdeploy_probe.fastdeploy_checks({"fastdeploy": {"available": True}}, None)
    assert not check.passed and "FastDeploy 2.0.0 does not accept" in check.detail
    assert "--served-model-name" in check.values["missing"]
    monkeypatch.setattr(fastdeploy_probe, "check_installed", lambda: FlagCheck(True, "2.3.0", [], "ok"))
    checks = fastdeploy_probe.fastdeploy_checks({"fastdeploy": {"available": True}}, None)
    assert [(c.name, c.passed) for c in checks] == [("fastdeploy", True), ("fastdeploy_env", True)]
    assert checks[1].values["python"] == str(python)


def test_fastdeploy_env_check_fails_when_its_pins_are_broken(monkeypatch, tmp_path):
    """`pip check` of FastDeploy's Python: the studio's uvicorn installed over FastDeploy's pin fails the node,
    naming the interpreter and pip's words."""
    from engine.doctor import fastdeploy_probe

    broken = "fastdeploy-gpu 2.3.0 has requirement uvicorn==0.29.0, but you have uvicorn 0.54.0.\n"
    python = fastdeploy_python_stand_in(tmp_path / "fd", "", broken, 1)
    monkeypatch.setenv("ERNIE_STUDIO_FASTDEPLOY_PYTHON", str(python))
    check = fastdeploy_probe.environment_check()
    assert not check.passed and str(python) in check.detail and "uvicorn==0.29.0" in check.detail
    monkeypatch.setenv("ERNIE_STUDIO_FASTDEPLOY_PYTHON", "python3.10")
    from engine.doctor.facts import fastdeploy_facts

    (refused,) = fastdeploy_probe.fastdeploy_checks({"fastdeploy": fastdeploy_facts()}, None)
    assert not refused.passed and "ERNIE_STUDIO_FASTDEPLOY_PYTHON='python3.10'" in refused.detail


def test_a_passing_report_is_reused_only_while_nothing_it_vouches_for_changed(tmp_path, quick_report):
    """The worker's start-up doctor reuses a recent passing report of the same node, floors, form and
    engine; other floors, an older report or a failed one run the checks again."""
    import json

    from engine.doctor import reuse

    floors = DoctorFloors()
    key = reuse.report_key(quick_report.facts, floors.model_dump(), False)
    reuse.save(tmp_path, key, quick_report.to_dict())
    again = run_doctor(full=False, floors=floors, reuse_s=600, cache_dir=tmp_path)
    assert again.reused_from is not None and again.passed
    assert [c.name for c in again.checks] == [c.name for c in quick_report.checks]
    assert again.to_dict()["reused_from"] == again.reused_from
    # the facts are read afresh; only RAM and GPU free memory may differ without changing the key
    assert reuse.report_key(again.facts, floors.model_dump(), False) == key
    assert reuse.report_key({**again.facts, "cpu_count": 99}, floors.model_dump(), False) != key
    assert reuse.report_key(again.facts, {**floors.model_dump(), "min_tokens_per_s": 1.0}, False) != key
    assert reuse.report_key(again.facts, floors.model_dump(), True) != key
    # too old: not reused
    saved = json.loads((tmp_path / f"{key}.json").read_text())
    saved["saved_at"] -= 601
    (tmp_path / f"{key}.json").write_text(json.dumps(saved))
    assert reuse.load_recent(tmp_path, key, 600) is None
    # a failed report is never kept
    reuse.save(tmp_path / "failed", key, {**quick_report.to_dict(), "passed": False})
    assert not (tmp_path / "failed").exists()


def test_the_gpu_checks_are_skipped_with_the_reason_on_a_cpu_node(tmp_path):
    from engine.doctor.gpu_checks import NAMES, gpu_checks

    facts = {"paddle": {"compiled_with_cuda": False}, "devices": []}
    checks = gpu_checks(facts, lambda preset: tmp_path / preset, tmp_path)
    assert [c.name for c in checks] == list(NAMES)
    assert all(c.passed and c.detail.startswith("skipped: needs a GPU") for c in checks)


def test_gpu_memory_is_read_from_the_device_asked_for_and_zero_is_unreadable(monkeypatch):
    # paddle.cuda.mem_get_info's binding switches to the device it is given (CUDADeviceGuard) and returns
    # (0, 0) when cudaMemGetInfo fails; the doctor asks per index and reports a zero total as unreadable.
    from types import SimpleNamespace

    from engine.doctor import facts

    asked = []
    memory = {"gpu:0": (3 * 2**30, 16 * 2**30), "gpu:1": (0, 0)}
    props = SimpleNamespace(name="T4", major=7, minor=5, total_memory=16 * 2**30)
    monkeypatch.setattr(paddle.device.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(paddle.cuda, "mem_get_info", lambda d: asked.append(d) or memory[d])
    good, bad = facts._gpu(0), facts._gpu(1)
    assert asked == ["gpu:0", "gpu:1"]
    assert good["free_memory_bytes"] == 3 * 2**30 and "error" not in good
    assert "memory unreadable" in bad["error"] and "free_memory_bytes" not in bad


def test_the_collectives_runs_need_are_checked_by_name():
    from types import SimpleNamespace

    import paddle.distributed as dist

    from engine.doctor.collectives import collective_check

    cpu = {"paddle": {"compiled_with_cuda": False}, "devices": []}
    check = collective_check(cpu)
    assert check.passed and check.values["expert_dispatch"] == "allgather"
    gpu = {"paddle": {"compiled_with_cuda": True}, "devices": [{"index": 0}]}
    assert collective_check(gpu).values["expert_dispatch"] == "alltoall"  # Paddle 3.3 has alltoall_single
    no_alltoall = SimpleNamespace(**{n: getattr(dist, n) for n in dir(dist) if n != "alltoall_single"})
    assert collective_check(cpu, no_alltoall).passed  # CPU nodes never call it
    check = collective_check(gpu, no_alltoall)
    assert not check.passed and "paddle.distributed.alltoall_single" in check.detail


def test_the_llamacpp_check_says_which_engine_auto_gives_a_cpu_deployment(monkeypatch):
    """With llama.cpp built (`make test` builds it), the check passes and says auto serves text models with
    it; ERNIE_STUDIO_CPU_SERVING=paddle is said too, and a value it does not know fails the check by name."""
    from engine.doctor.llamacpp_probe import llamacpp_checks

    monkeypatch.delenv("ERNIE_STUDIO_CPU_SERVING", raising=False)
    (check,) = llamacpp_checks()
    assert check.passed and check.values["cpu_serving"] == "llamacpp", check
    assert "auto serves text models on CPU with it" in check.detail, check.detail
    monkeypatch.setenv("ERNIE_STUDIO_CPU_SERVING", "paddle")
    (check,) = llamacpp_checks()
    assert check.passed and "auto keeps CPU deployments on the built-in server" in check.detail, check.detail
    monkeypatch.setenv("ERNIE_STUDIO_CPU_SERVING", "gpu")
    (check,) = llamacpp_checks()
    assert not check.passed and "ERNIE_STUDIO_CPU_SERVING must be one of llamacpp, paddle" in check.detail
