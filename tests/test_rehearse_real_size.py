"""scripts/rehearse_real_size.py: checkpoints of the real MoE configurations, written a layer at a time.

At tiny widths (``--tiny``, same structure) every named configuration is written as Hub-style
safetensors shards with an index, loads with moee's loader in bfloat16, and holds exactly the
tensors of a model built directly from the same seeded state, so its forward is that model's. At
full depth (on the ``meta`` device, no memory) each configuration has its published parameter
count. The measured ``run`` steps work end to end on a tiny folder.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "rehearse_real_size.py"


@pytest.fixture(scope="module")
def rehearse():
    spec = importlib.util.spec_from_file_location("rehearse_real_size", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


NAMES = ("olmoe-1b-7b", "qwen1.5-moe-a2.7b", "deepseek-moe-16b", "gpt-oss-20b", "qwen3-30b-a3b")


@pytest.mark.parametrize("name", NAMES)
def test_full_depth_has_the_published_parameter_count(rehearse, name):
    model = rehearse.meta_model(rehearse.build_config(name))
    count = sum(p.numel() for p in model.parameters())
    assert count == pytest.approx(rehearse.CONFIGS[name]["params"], rel=0.01)
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_a_written_folder_loads_and_is_the_model_of_its_state(rehearse, name, tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from moee.loading import LoadOptions, load_model

    folder = tmp_path / name
    manifest = rehearse.write_checkpoint(name, folder, tiny=True, shard_bytes=4_000_000)
    assert manifest["shards"] >= 2  # the index and the shard boundaries are exercised
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    stored = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(folder / shard, "pt") as f:
            stored.update({key: shard for key in f.keys()})
    assert stored == index["weight_map"]
    assert index["metadata"]["total_size"] == manifest["weight_bytes"]
    if name != "gpt-oss-20b":  # stored per expert, as on the Hub (gpt-oss keeps fused experts)
        assert any(".experts.0." in key for key in stored), sorted(stored)[:5]

    loaded = load_model(folder, LoadOptions(dtype="bfloat16", device="cpu"))
    model = loaded.model.eval()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert len(loaded.tokenizer) <= model.config.vocab_size
    config = AutoConfig.from_pretrained(folder)
    direct = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    direct.load_state_dict(rehearse.model_state(config, seed=0), strict=True)
    theirs = direct.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, theirs[key]), key
    batch = loaded.tokenizer(["the cat sat on the mat", "a dog"], return_tensors="pt", padding=True)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, direct(**batch).logits)
    matrices = [
        (n, p) for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n and "bias" not in n
    ]
    stds = [float(p.detach().float().std()) for _, p in matrices]
    assert 0.015 < min(stds) and max(stds) < 0.025, stds  # the config's initializer_range, 0.02


@pytest.mark.slow
def test_the_writer_holds_one_part_at_a_time_at_real_width(rehearse, tmp_path):
    """DeepSeekMoE-16B's per-expert tensors at their real widths, 4 MoE layers of 1.18 GB: the
    writer's peak resident memory stays under two such layers over its start (it kept every layer
    resident before the heap was trimmed, 4.4 GB here, 24 GB at 11 layers, and was killed)."""
    import subprocess

    out = tmp_path / "ds"
    subprocess.run(
        [sys.executable, str(SCRIPT), "write", "deepseek-moe-16b", "--layers", "5", "--out", str(out)],
        check=True,
        timeout=600,
    )
    manifest = json.loads((out / rehearse.MANIFEST).read_text())
    config = rehearse.build_config("deepseek-moe-16b", layers=5)
    largest = max(
        sum(p.numel() * p.element_size() for p in module.parameters())
        for _, module in rehearse.model_parts(rehearse.meta_model(config))
    )
    assert manifest["weight_bytes"] > 4 * largest  # the run writes several parts of this size
    assert manifest["write_vm_hwm_bytes"] < 0.8e9 + 1.5 * largest, (manifest["write_vm_hwm_bytes"], largest)


def test_reduced_depth_and_unknown_names_are_checked(rehearse):
    assert rehearse.build_config("olmoe-1b-7b", layers=2).num_hidden_layers == 2
    config = rehearse.build_config("gpt-oss-20b", layers=3)
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    with pytest.raises(SystemExit, match="--layers must be in 2..28"):
        rehearse.build_config("deepseek-moe-16b", layers=1)  # its first layer is dense: no MoE left
    with pytest.raises(SystemExit, match="unknown configuration"):
        rehearse.build_config("olmoe-7b")


@pytest.mark.slow
def test_the_measured_steps_run_on_a_tiny_folder(rehearse, tmp_path):
    folder = tmp_path / "tiny-olmoe"
    rehearse.write_checkpoint("olmoe-1b-7b", folder, tiny=True)
    out = tmp_path / "result.json"
    argv = [
        "run",
        str(folder),
        "--texts",
        "12",
        "--steps",
        "embed,serve,capture,oracle",
        "--capture-repeats",
        "3",
        "--result",
        str(out),
    ]
    assert rehearse.main([*argv, "--delete"]) == 0
    document = json.loads(out.read_text())
    steps = {step["step"]: step for step in document["steps"]}
    assert set(steps) == {"embed", "serve", "capture", "oracle"}
    for step in steps.values():
        assert step["returncode"] == 0 and step["loads"] == 1, step
        assert (
            step["rss_anon_before_load_bytes"]
            < step["rss_anon_after_load_bytes"]
            <= step["peak_rss_anon_bytes"]
        )
        assert step["peak_held_bytes"] >= step["peak_rss_anon_bytes"]
    assert steps["serve"]["texts"] == 12 and steps["serve"]["vectors_finite"]
    assert steps["oracle"]["check"]["passed"] and steps["oracle"]["check"]["dtype"] == "torch.bfloat16"
    overhead = steps["capture"]["overhead"]  # encode(rw) against a plain forward of the same batches
    assert overhead["dtype"] == "torch.bfloat16" and overhead["repeats"] == 3 and overhead["texts"] == 12
    assert 0.5 < overhead["median_ratio_encode_rw_vs_plain"] < 5
    assert overhead["torch_threads"] >= 1 and "3 interleaved pairs" in steps["capture"]["command"]
    assert document["deleted"] and not folder.exists()


def test_the_oracle_step_loads_with_the_run_s_memory_cap_and_disk_offload(rehearse, tmp_path):
    """A model larger than memory is checked the way the other steps load it: ``--load-flags``
    reach the oracle's own load (before, it loaded everything into memory, which a 28.6 GB model
    on a 24 GB machine cannot survive)."""
    folder = tmp_path / "tiny-olmoe"
    manifest = rehearse.write_checkpoint("olmoe-1b-7b", folder, tiny=True)
    out, offload = tmp_path / "oracle.json", tmp_path / "offload"
    offload.mkdir()
    flags = ["--device-map", "auto", "--max-memory", f"cpu={manifest['weight_bytes'] // 2}"]
    assert rehearse.oracle_main(str(folder), str(out), [*flags, "--offload-folder", str(offload)]) == 0
    check = json.loads(out.read_text())
    assert check["passed"] and check["dtype"] == "torch.bfloat16", check
    assert check["offloaded_parameters"] > 0  # the layers beyond the cap were on disk while checked
    with pytest.raises(ValueError, match="only applies with --device-map"):  # as on every command
        rehearse.oracle_main(str(folder), str(out), ["--max-memory", "cpu=1GiB"])


def _render_and_l2_result():
    """write_benchmarks_md's ``render`` and the committed 2-layer OLMoE result, the fixture of the
    section-13 tests."""
    scripts = str(SCRIPT.parent)
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    from write_benchmarks_md import render

    committed = SCRIPT.parent.parent / "bench" / "results" / "rehearsal" / "olmoe-1b-7b-L2.json"
    return render, committed, json.loads(committed.read_text())


def test_benchmarks_md_renders_the_rehearsal_results(tmp_path):
    """BENCHMARKS.md section 13 comes from bench/results/rehearsal/*.json (no figure typed by hand)."""
    render, committed, result = _render_and_l2_result()
    (tmp_path / "rehearsal").mkdir()
    (tmp_path / "rehearsal" / committed.name).write_text(json.dumps(result))
    text = render(tmp_path, tmp_path / "missing.json")
    section = text.split("## 13. Real widths, full and reduced depth")[1].split("\n## ")[0]
    embed = next(s for s in result["steps"] if s["step"] == "embed")
    assert f"**{embed['peak_held_over_weights']:.2f}x**" in section
    assert result["command"] in section and result["checkpoint"]["command"] in section
    assert "Oracle check in bfloat16" in section and "Reading:" in section
    assert "| 13 | real widths" in text
    empty = render(tmp_path / "none", tmp_path / "missing.json")
    assert "rehearse_real_size.py write olmoe-1b-7b" in empty.split("## 13.")[1]  # not run: its command


def test_benchmarks_md_reads_an_offloaded_run_against_its_cap_and_a_fused_checkpoint_without_a_join(
    tmp_path,
):
    """A run larger than memory is judged by its peak held memory against its --max-memory cap plus
    what a model held in memory adds (not by held / weights),
    and a checkpoint whose experts are stored fused is not said to join per-expert tensors."""
    render, committed, base = _render_and_l2_result()
    (tmp_path / "rehearsal").mkdir()
    offloaded = json.loads(json.dumps(base))
    offloaded["checkpoint"].update(configuration="big", hub_id="org/big", layers=16, full_layers=16)
    offloaded["command"] += " --load-flags '--device-map auto --max-memory cpu=1GiB --offload-folder /x'"
    for step in offloaded["steps"]:
        if step["step"] == "oracle":
            step["check"]["offloaded_parameters"] = 123
    (tmp_path / "rehearsal" / "big.json").write_text(json.dumps(offloaded))
    peak = max(s["peak_held_bytes"] for s in offloaded["steps"] if "loads" in s)
    text = render(tmp_path, tmp_path / "missing.json")
    section = text.split("### org/big")[1].split("\n### ")[0]
    assert "`--device-map auto --max-memory cpu=1GiB` (1.07 GB" in section
    # 3.28 GB held over a 1.07 GB cap + 2 GB (no full-depth in-memory run here to measure the allowance)
    assert f"{peak / 1e9:.2f} GB, so **missed**" in section and "an assumed 2 GB" in section
    assert "| 13 | real widths" in text and "(disk offload) | bounded by the cap |" in text
    # under a cap above the peak the verdict flips
    offloaded["command"] = offloaded["command"].replace("cpu=1GiB", "cpu=8GiB")
    (tmp_path / "rehearsal" / "big.json").write_text(json.dumps(offloaded))
    assert (
        "so **met**" in render(tmp_path, tmp_path / "missing.json").split("### org/big")[1].split("\n### ")[0]
    )

    fused = json.loads(json.dumps(base))
    for step in fused["steps"]:
        if "loads" in step:
            step["mapped_weight_bytes"] = fused["checkpoint"]["weight_bytes"]
    (tmp_path / "rehearsal" / "big.json").unlink()
    (tmp_path / "rehearsal" / committed.name).write_text(json.dumps(fused))
    section = render(tmp_path, tmp_path / "missing.json").split("## 13.")[1]
    assert "already fused" in section and "nothing to join" in section
    assert "joins the checkpoint's per-expert tensors" not in section
    assert "no full-depth run of this model here" in section


def test_a_rerun_replaces_only_its_steps_and_is_recorded(rehearse, tmp_path):
    """`run --steps oracle --rerun` after a fix: the earlier result keeps its other steps and its own
    record; the rerun is listed; a result of another checkpoint is refused."""
    committed = SCRIPT.parent.parent / "bench" / "results" / "rehearsal" / "olmoe-1b-7b-L2.json"
    earlier = json.loads(committed.read_text())
    path = tmp_path / "r.json"
    path.write_text(json.dumps(earlier))
    oracle = {"step": "oracle", "returncode": 0, "check": {"passed": True}}
    document = {"checkpoint": {**earlier["checkpoint"], "command": "write ..."}, "steps": [oracle]}
    merged = rehearse.rerun_into(path, document)
    assert [s["step"] for s in merged["steps"]] == [s["step"] for s in earlier["steps"]]
    assert next(s for s in merged["steps"] if s["step"] == "oracle") == oracle
    assert next(s for s in merged["steps"] if s["step"] == "embed") == earlier["steps"][0]
    assert merged["command"] == earlier["command"] and merged["utc"] == earlier["utc"]
    assert merged["reruns"][-1]["steps"] == ["oracle"] and merged["reruns"][-1]["write"] == "write ..."
    other = {"checkpoint": {**earlier["checkpoint"], "layers": 3}, "steps": [oracle]}
    with pytest.raises(SystemExit, match="another checkpoint"):
        rehearse.rerun_into(path, other)
    with pytest.raises(SystemExit, match="no earlier result"):
        rehearse.rerun_into(tmp_path / "missing.json", document)


def test_the_capture_verdict_is_settled_only_when_the_timing_had_its_cores():
    """A paired ratio is trusted when the timed threads got their cores (``cpu_share``), else, for
    results without it, when the load average stayed within the cores; otherwise 'not settled'."""
    _render_and_l2_result()  # puts scripts/ on the path
    from write_benchmarks_md import CAPTURE_GOAL, _capture_reading

    base = {
        "repeats": 12,
        "texts": 32,
        "tokens": 1056,
        "median_s": {"plain_forward": 5.0},
        "load_average_1m": 3.0,
    }
    reading = _capture_reading({**base, "median_ratio_encode_rw_vs_plain": 1.0, "cpu_share": 0.97}, cpus=2)
    assert "**met**" in reading and "97%" in reading and f"goal <= {CAPTURE_GOAL}" in reading
    assert "**missed**" in _capture_reading(
        {**base, "median_ratio_encode_rw_vs_plain": 1.05, "cpu_share": 0.9}, 2
    )
    assert "not settled" in _capture_reading(
        {**base, "median_ratio_encode_rw_vs_plain": 1.0, "cpu_share": 0.89}, 2
    )
    assert "not settled" in _capture_reading(
        {**base, "median_ratio_encode_rw_vs_plain": 1.0}, 2
    )  # load 3 > 2
    assert "**met**" in _capture_reading(
        {**base, "median_ratio_encode_rw_vs_plain": 1.0, "load_average_1m": 2.0}, 2
    )


def test_the_capture_summary_row_is_met_only_when_every_rehearsal_is_settled_and_met():
    _render_and_l2_result()
    from write_benchmarks_md import _capture_row

    def result(name, ratio, share):
        capture = {"median_ratio_encode_rw_vs_plain": ratio, "cpu_share": share, "load_average_1m": 2.0}
        return {
            "checkpoint": {"configuration": name},
            "machine": {"logical_cpus": 2},
            "steps": [{"step": "embed"}, {"step": "capture", "overhead": capture}],
        }

    assert _capture_row([{"checkpoint": {}, "machine": {}, "steps": [{"step": "embed"}]}]) is None
    row = _capture_row([result("a", 0.99, 0.95), result("b", 1.01, 0.92)])
    assert row[-1] == "met" and row[3] == "a 0.990; b 1.010"
    assert _capture_row([result("a", 0.99, 0.95), result("b", 1.01, 0.5)])[-1] == "not settled"
    assert _capture_row([result("a", 1.05, 0.95), result("b", 1.01, 0.5)])[-1] == "**missed**"


def test_a_capture_step_of_no_pairs_is_refused_before_anything_runs(rehearse, tmp_path, capsys):
    with pytest.raises(SystemExit):
        rehearse.main(["run", str(tmp_path / "absent"), "--capture-repeats", "0"])
    assert "--capture-repeats must be at least 1, got 0" in capsys.readouterr().err
