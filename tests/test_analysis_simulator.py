"""Router-collapse simulator: its rules (moee/analysis/simulator.py), determinism, collapse off / no collapse on."""

import json

import numpy as np
import pytest

from moee.analysis.simulator import (
    DIM,
    RED,
    TEAL,
    TOKENS_PER_STEP,
    SimulatorConfig,
    bar_colours,
    blend_sweep,
    run_showcase,
    simulate,
)
from moee.cli import main


def test_same_seed_same_run_other_seed_other_run():
    a, b = simulate(seed=3), simulate(seed=3)
    assert np.array_equal(a.loads, b.loads) and np.array_equal(a.strengths, b.strengths)
    assert not np.array_equal(a.loads, simulate(seed=4).loads)


@pytest.mark.parametrize("seed", range(5))
def test_default_setting_collapses_off_and_stays_flat_on(seed):
    off = simulate(SimulatorConfig(seed=seed))  # documented default: n=8, 200 steps, blend 0
    on = simulate(SimulatorConfig(seed=seed, blend=1.0))
    assert off.max_over_mean[-1] > 2.2
    assert on.max_over_mean[-1] < 2.2
    assert on.max_over_mean[-1] < 1.5  # Shazeer et al. (2017) Table 6's balanced range is 1.07-1.47


def test_every_step_routes_forty_tokens():
    run = simulate(n=12, steps=30)
    assert (run.loads.sum(axis=1) == TOKENS_PER_STEP).all()
    assert run.cumulative[-1].sum() == 30 * TOKENS_PER_STEP


def test_off_rule_is_the_seeds_multiplicative_update_with_floor():
    run = simulate(n=8, steps=60, seed=1)
    mean = TOKENS_PER_STEP / 8
    prev = np.vstack([np.ones(8), run.strengths[:-1]])
    expected = np.clip(prev * (1 + 0.18 * (run.loads / mean - 1)), run.config.floor, None)
    np.testing.assert_allclose(run.strengths, expected)
    assert run.strengths.min() >= run.config.floor


def test_on_rule_pulls_halfway_to_one_so_strength_stays_one():
    run = simulate(n=8, steps=50, blend=1.0)
    np.testing.assert_array_equal(run.strengths, np.ones_like(run.strengths))


def test_blend_interpolates_the_two_rules():
    run = simulate(n=8, steps=40, blend=0.3, seed=2)
    mean = TOKENS_PER_STEP / 8
    prev = np.vstack([np.ones(8), run.strengths[:-1]])
    off = prev * (1 + 0.18 * (run.loads / mean - 1))
    on = prev * 0.5 + 0.5
    np.testing.assert_allclose(run.strengths, np.clip(0.7 * off + 0.3 * on, run.config.floor, None))


def test_blend_sweep_is_monotone_enough_to_find_the_threshold():
    sweep = blend_sweep([0.0, 1.0], ns=[8], seeds=[0, 1])
    assert sweep["collapsed_fraction"] == [[1.0, 0.0]]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 3},
        {"n": 17},
        {"blend": 1.5},
        {"blend": -0.1},
        {"steps": 0},
        {"floor": 0.0},
        {"jitter_std": -1.0},
    ],
)
def test_bad_config_raises(kwargs):
    with pytest.raises(ValueError):
        SimulatorConfig(**kwargs)
    with pytest.raises(TypeError):
        SimulatorConfig(n=8.0)


def test_bar_colours_follow_the_seed_thresholds():
    # mean 10: > 22 red, < 4 dim, otherwise teal (boundaries are not red / not dim)
    cum = np.array([23, 22, 4, 3.9, 10, 0.1 + 7])
    cum = np.append(cum, 10 * 7 - cum.sum())  # force mean 10 over 7 bars
    assert np.isclose(cum.mean(), 10)
    colours = bar_colours(cum)
    assert colours[:5] == [RED, TEAL, TEAL, DIM, TEAL]


@pytest.mark.slow
def test_run_showcase_writes_frames_pngs_and_json(tmp_path):
    payload = run_showcase(tmp_path, blends=(0.0, 1.0), steps=10, frame_every=5, command=["test"])
    for name in ("simulate_off.gif", "simulate_on.gif", "simulate_final.png", "simulate_max_over_mean.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:4] in (b"GIF8", b"\x89PNG")
    saved = json.loads((tmp_path / "simulation.json").read_text())
    assert saved["runs"]["off"]["config"]["blend"] == 0.0
    assert saved["constants"]["tokens_per_step"] == 40
    assert saved["meta"]["command"] == "test"
    assert payload["runs"]["on"]["final_max_over_mean"] < 2.2


def test_cli_simulate(tmp_path, capsys):
    rc = main(
        [
            "simulate",
            "--steps",
            "30",
            "--balancing",
            "off",
            "--blend",
            "0.5",
            "--no-gif",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    saved = json.loads((tmp_path / "simulation.json").read_text())
    assert set(saved["runs"]) == {"off", "blend0.5"}
    assert "final max/mean" in capsys.readouterr().out
    assert main(["simulate", "--n", "40", "--out", str(tmp_path)]) == 2
