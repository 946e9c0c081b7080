"""LoRA (PEFT) students on 2 real ranks: training, optimizer state, resume, export, feature losses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import rank_results
from launch import ROOT, run_ranks
from tolerances import assert_float32_equivalent

from distill_kit.engines import peft_student
from distill_kit.engines.peft_student import AdapterConfig
from distill_kit.errors import ConfigError
from distill_kit.run import run_config, validate

WORKER = ROOT / "tests/workers/peft_scenarios.py"
multirank = pytest.mark.multirank

WIDTH, MLP, RANK = 32, 128, 4  # tiny_models' student: GPT-2, width 32, one layer; adapters of rank 4


def test_bad_peft_settings_are_config_errors_naming_the_fix():
    with pytest.raises(ConfigError, match=r"unknown config key 'students\[0\].peft.rr': did you mean"):
        run_config.load(None, ["students=[{name: a, peft: {rr: 4}}]"])
    with pytest.raises(ConfigError, match=r"peft.r must be >= 1, got 0"):
        run_config.load(None, ["students=[{name: a, peft: {r: 0}}]"])
    with pytest.raises(ValueError, match=r"unknown peft keys \['rank'\]; a peft entry has r, alpha"):
        peft_student.adapter_config({"rank": 4})


def test_a_zero3_lora_student_is_refused_before_anything_loads(tmp_path):
    """One of the CLI's up-front checks (validate.py: they run before anything is loaded or written)."""
    config = run_config.load(None, ["students=[{name: a, init: {num_hidden_layers: 1}, peft: {r: 4}}]",
                                    "student_ds_overrides={zero_optimization.stage: 3}",
                                    f"output_dir={tmp_path / 'run'}"])
    random, zero3 = validate.check_plan(validate.Start(config, False, {}))  # every problem at once
    assert random.startswith("students[a].peft: LoRA adapters train on a frozen pretrained student, but this")
    assert zero3 == ("students[a].peft: a PEFT student trains under ZeRO stage 0-2 (its frozen base is replicated, "
                     "only the adapters are trained and sharded); set the student's zero_optimization.stage to 2")
    assert validate.check_plan in validate.CHECKS  # the plan the Distiller builds from, made before any work


def test_a_missing_peft_library_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` now raises ImportError
    with pytest.raises(ImportError, match=r"needs the peft library: install it with `pip install peft`"):
        peft_student.lora_config(AdapterConfig(r=4))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[str, list[dict]]:
    out: Path = tmp_path_factory.mktemp("peft")
    run_ranks(WORKER, [str(out)], nprocs=2, timeout=300)
    return rank_results.read(out, 2)


@multirank
def test_lora_student_matches_a_plain_loop_and_trains_only_the_adapters(ranks):
    """ZeRO-2 engine over 2 ranks with accumulation = torch AdamW over the adapters on the union of the batches."""
    for result in ranks["lora_trains"]:
        assert result["max_param_change"] > 1e-3  # the adapters moved
        assert_float32_equivalent(result)  # the bound follows from float32 rounding on this CPU: tests/tolerances.py
        assert result["base_change"] == 0.0  # the base is frozen, bit for bit
        for got, want in zip(result["losses"], result["ref_losses"], strict=True):
            assert got == pytest.approx(want, rel=1e-5)


@multirank
def test_optimizer_state_is_sized_to_the_adapters(ranks):
    """LoRA on c_attn (32 -> 96) and c_fc (32 -> 128): r * (d_in + d_out) each; ZeRO-2 halves it per rank."""
    adapter_params = RANK * ((WIDTH + 3 * WIDTH) + (WIDTH + MLP))
    for result in ranks["lora_trains"]:
        assert result["counts"]["trained"] == adapter_params
        assert result["counts"]["frozen"] > 10 * adapter_params
        assert result["optimizer_partition"] == adapter_params // 2
        assert result["adam_state"] == {"exp_avg": adapter_params // 2, "exp_avg_sq": adapter_params // 2}


@multirank
def test_lora_student_resumes_exactly_from_a_checkpoint_of_adapters(ranks):
    for result in ranks["resume_and_export"]:
        assert result["resumed_from"] == "step_00000002"
        assert result["resumed_losses"] == result["whole_losses"]
        assert result["resumed_diff"] == 0.0


@multirank
def test_checkpoint_holds_no_frozen_block_weights(ranks):
    keys = ranks["resume_and_export"][0]["module_keys"]
    assert any("lora_A" in k for k in keys) and any("lora_B" in k for k in keys)
    # Only adapters: not the output head either, which GPT-2 ties to the (frozen) embedding under a second name.
    assert [k for k in keys if "lora_" not in k] == []
    assert ranks["resume_and_export"][0]["tied_head"]  # the student does tie them (the case that needs the fix)


@multirank
def test_another_base_is_refused_on_resume(ranks):
    for result in ranks["resume_and_export"]:
        assert "frozen base weights" in result["refusal"] and "Resume with the student model" in result["refusal"]


@multirank
def test_merged_export_loads_and_gives_the_engines_logits(ranks):
    for result in ranks["resume_and_export"]:
        assert {"adapter_config.json", "adapter_model.safetensors", "merged"} <= set(result["export_files"])
        assert not result["merged_has_lora"]  # a plain transformers model
        assert result["merged_vs_engine"] < 1e-5  # the merge folds B A into W: equal up to float32 rounding
        assert result["adapter_vs_engine"] == 0.0  # the adapter folder on its base: the same computation


@multirank
def test_hidden_state_and_attention_losses_work_on_a_lora_student(ranks):
    """At step 1 LoRA's B is 0, so the PEFT student is its base: every part equals the plain student's."""
    for result in ranks["feature_losses"]:
        lora, plain = result["lora_first"], result["plain_first"]
        for part in ("forward_kl", "hidden_mse", "attention_kl"):
            assert lora[part] == pytest.approx(plain[part], rel=1e-6)
            assert lora[part] > 0
        assert result["projection_change"] > 1e-4  # the hidden projection trains with the adapters
        assert result["adapter_change"] > 1e-4
