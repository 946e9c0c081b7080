"""Quantized students (``students[i].quantize``, ``engines/quantize.py``): the fake quantisation is torchao's own
quantize-dequantize, bit for bit; the exported low-bit folder computes what the fake-quantised student computed; a
resumed quantized run equals the uninterrupted one; every refusal comes from the plan, before anything is written."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from tiny_models import gpt2_config, llama_config, random_batches
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from distill_kit import Distiller, StudentSpec, TeacherSpec, TrainingConfig
from distill_kit.config import DeepSpeedSettings, QuantizeConfig
from distill_kit.engines import quantize
from distill_kit.errors import ConfigError
from distill_kit.run import run_config
from distill_kit.training.plan import make_plan

pytest.importorskip("torchao")

GROUP = 16  # divides the tiny Llama's input widths: hidden 32, attention 4 x 8 = 32, MLP 48
INT_SCHEMES = ("int4_weight_only", "int8_dynamic_act_int4_weight")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    """A tiny Llama (nn.Linear projections), saved: the teacher, and the QAD student's starting point."""
    directory = tmp_path_factory.mktemp("quantize") / "teacher"
    torch.manual_seed(7)
    LlamaForCausalLM(llama_config()).save_pretrained(directory)
    return directory


# ---- the fake quantisation is torchao's ------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", INT_SCHEMES)
def test_fake_quantisation_is_torchaos_quantize_dequantize_bitwise(teacher_dir, scheme):
    """Each decoder linear's fake-quantised weight equals torchao's PTQ of the same weight (``quantize_`` with the
    scheme's base config, then ``dequantize``) exactly; the head and embeddings stay as they were; for 8da4w the
    activation fake quantiser equals the converted tensor's own per-token int8 quantize-dequantize."""
    from torchao.quantization import quantize_
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
        _apply_int8_act_asym_per_token_quant_dequant,
    )

    spec = QuantizeConfig(scheme, group_size=GROUP)
    model = AutoModelForCausalLM.from_pretrained(teacher_dir)
    ptq = copy.deepcopy(model)
    quantize_(ptq, quantize.base_config(spec), filter_fn=quantize.quantized_layers(ptq))
    quantize.prepare(model, spec)
    names = quantize.fake_quantized(model)
    assert len(names) == 4 * 7  # q, k, v, o, gate, up, down in each of the 4 layers; not the head
    real = dict(ptq.named_modules())
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(0))
    for name in names:
        layer = model.get_submodule(name)
        assert torch.equal(layer.weight_fake_quantizer(layer.weight), real[name].weight.dequantize()), name
        if scheme == "int8_dynamic_act_int4_weight":
            assert torch.equal(layer.activation_fake_quantizer(x), _apply_int8_act_asym_per_token_quant_dequant(x))
    assert type(model.lm_head).__name__ == "Linear" and type(model.lm_head.weight) is torch.nn.Parameter


def test_learned_scales_start_as_torchaos_initialisation_without_a_model_forward(teacher_dir):
    """``learn_scales`` initialises each weight quantiser on its own weight, not by a forward of the model (which
    would run the student's kernels, GPU-only ones too, while it is still on the CPU: the 2026-12-04 H200 grid
    failed there in Liger's rope). The scales equal those of torchao's ``initialize_fake_quantizers`` bitwise."""
    from torchao.quantization.qat import initialize_fake_quantizers

    spec = QuantizeConfig("int4_weight_only", group_size=GROUP, learn_scales=True)
    model = AutoModelForCausalLM.from_pretrained(teacher_dir)
    reference = copy.deepcopy(model)
    model.forward = None  # any model forward during prepare fails here
    quantize.prepare(model, spec)
    ids = torch.zeros(1, 1, dtype=torch.long)

    def torchao_prepare(m):  # prepare's torchao calls, then torchao's own initialisation (a forward)
        from torchao.quantization import quantize_
        from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig
        from torchao.quantization.qat.fake_quantize_config import _infer_fake_quantize_configs

        _, weight = _infer_fake_quantize_configs(quantize.base_config(spec))
        learned = IntxFakeQuantizeConfig(weight.dtype, weight.granularity, mapping_type=weight.mapping_type,
                                         is_dynamic=False, range_learning=True)
        quantize_(m, QATConfig(weight_config=learned, step="prepare"), filter_fn=quantize.quantized_layers(m))
        with torch.no_grad():
            initialize_fake_quantizers(m, (ids,))

    torchao_prepare(reference)
    names = quantize.fake_quantized(model)
    assert len(names) == 28
    for name in names:
        ours = model.get_submodule(name).weight_fake_quantizer
        theirs = reference.get_submodule(name).weight_fake_quantizer
        assert isinstance(ours.scale, torch.nn.Parameter) and torch.equal(ours.scale, theirs.scale), name
        assert torch.equal(ours.zero_point, theirs.zero_point), name


def test_a_run_config_builds_the_typed_setting_and_refuses_a_bad_one():
    config = run_config.load(None, ["students=[{name: q, quantize: {scheme: int4_weight_only, group_size: 32}}]"])
    assert config.students[0].quantize == QuantizeConfig("int4_weight_only", 32)
    with pytest.raises(ConfigError, match=r"students\[0\].quantize.scheme: 'int3' is not one of"):
        run_config.load(None, ["students=[{name: q, quantize: {scheme: int3}}]"])
    with pytest.raises(ConfigError, match=r"unknown config key 'students\[0\].quantize.group': did you mean"):
        run_config.load(None, ["students=[{name: q, quantize: {group: 32}}]"])


# ---- refusals, from the plan ----------------------------------------------------------------------------------


def _plan(teacher_dir: Path, student: StudentSpec, output_dir: Path | None = None) -> None:
    make_plan([student], [TeacherSpec(name="t", model=str(teacher_dir))], training=TrainingConfig(), world_size=1,
              output_dir=output_dir)


def test_every_bad_quantized_student_is_refused_by_the_plan_at_once(teacher_dir, tmp_path):
    """Group size, LoRA and ZeRO-3 in one ConfigError, each naming its key and its fix; FP8 on this CPU names the
    schemes that run here."""
    spec = StudentSpec(name="q", model=str(teacher_dir), quantize=QuantizeConfig("int4_weight_only", 32),
                       peft={"r": 4}, ds_overrides={"zero_optimization.stage": 3})
    with pytest.raises(ConfigError) as err:
        _plan(teacher_dir, spec, output_dir=tmp_path / "run")
    message = str(err.value)
    assert "students[q].quantize: quantize.group_size 32 does not divide the input width of every quantised layer " \
           "(widths [32, 48]; [48] are not multiples): set quantize.group_size to one that divides them all (16, 8)" \
           in message
    assert "students[q].quantize: LoRA adapters on a quantized student are not supported" in message
    assert "students[q].quantize: a quantized student trains under ZeRO stage 0-2" in message
    fp8 = dataclasses.replace(spec, quantize=QuantizeConfig("fp8"), peft=None, ds_overrides={})
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"students\[q\].quantize: fp8 needs FP8 tensor cores .* this machine has "
                                              r"no CUDA GPU; schemes that run here: int4_weight_only, "
                                              r"int8_dynamic_act_int4_weight$"):
            _plan(teacher_dir, fp8)
    assert not (tmp_path / "run").exists()  # refused from the plan: no folder, no checkpoint written


def test_nvfp4_off_blackwell_and_a_conv1d_student_are_refused_with_what_can_run(teacher_dir):
    hopper = quantize.problems(QuantizeConfig("nvfp4"), llama_config(), zero_stage=2, peft=False, capability=(9, 0))
    assert hopper == ["nvfp4 needs FP4 tensor cores (Blackwell), compute capability 10.0+, and this GPU has compute "
                      "capability 9.0; schemes that run here: int4_weight_only, int8_dynamic_act_int4_weight, fp8"]
    blackwell = quantize.problems(QuantizeConfig("mxfp4"), llama_config(), zero_stage=2, peft=False,
                                  capability=(10, 0))
    assert blackwell == ["mxfp4's block of 32 does not divide the input width of every quantised layer (widths [32, "
                         "48]; [48] are not multiples): choose widths that are multiples of it, or another scheme"]
    learned_fp8 = quantize.problems(QuantizeConfig("fp8", learn_scales=True), llama_config(), zero_stage=2,
                                    peft=False, capability=(9, 0))
    assert learned_fp8 == ["learn_scales trains int4 group scales (torchao's range learning): fp8 has none to learn; "
                           "use int4_weight_only or int8_dynamic_act_int4_weight, or drop learn_scales"]
    gpt2 = quantize.problems(QuantizeConfig("int4_weight_only", GROUP), gpt2_config(32, 1), zero_stage=2,
                             peft=False, capability=None)
    assert gpt2 == ["model type 'gpt2' computes its projections with Conv1D, and torchao's QAT fake-quantises "
                    "nn.Linear only: use a student of a Llama-, Qwen2- or Mistral-like architecture, or drop quantize"]


def test_a_scheme_the_installed_torchao_cannot_convert_is_refused(teacher_dir, monkeypatch):
    monkeypatch.setitem(quantize.BASE_CONFIGS, "int4_weight_only", ("torchao.quantization", "NoSuchConfig"))
    with pytest.raises(ConfigError, match=r"students\[q\].quantize: torchao 0.18.0 has no "
                                          r"torchao.quantization.NoSuchConfig to convert int4_weight_only with"):
        _plan(teacher_dir, StudentSpec(name="q", model=str(teacher_dir), quantize=QuantizeConfig(group_size=GROUP)))
    monkeypatch.setattr(quantize.importlib.util, "find_spec", lambda name: None)
    assert quantize.why_not_convertible("fp8") == ("torchao is not installed: pip install 'torchao==0.18.0' (or pip "
                                                   "install 'distill-kit[quantize]')")


# ---- training, export, resume: real ZeRO-2 engines on one rank ------------------------------------------------


SCHEME = QuantizeConfig("int8_dynamic_act_int4_weight", group_size=GROUP)
LEARNED = QuantizeConfig("int4_weight_only", group_size=GROUP, learn_scales=True)


def _distiller(teacher_dir: Path, folder: Path) -> Distiller:
    """QAD: the students start as the teacher itself, fake-quantised (``l`` with learned int4 scales); a replicated
    fp32 teacher (stage 0)."""
    return Distiller(students=[StudentSpec(name="q", model=str(teacher_dir), quantize=SCHEME),
                               StudentSpec(name="l", model=str(teacher_dir), quantize=LEARNED)],
                     teachers=[TeacherSpec(name="t", model=str(teacher_dir))],
                     training=TrainingConfig(max_steps=4, lr=1e-2, micro_batch_size=2, save_every=2,
                                             checkpoint_dir=str(folder)),
                     deepspeed=DeepSpeedSettings(teacher_overrides={"zero_optimization.stage": 0}))


@pytest.fixture(scope="module")
def trained(teacher_dir, tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("qad")
    distiller = _distiller(teacher_dir, folder / "checkpoints")
    records = distiller.train(random_batches(4, 2, 16, seed=3))
    exported = distiller.export(folder / "export")
    return {"distiller": distiller, "records": records, "folder": folder, "export": exported["q"],
            "learned_export": exported["l"]}


@pytest.mark.slow
def test_the_zero2_engine_trains_the_fake_quantised_student(trained, teacher_dir):
    distiller = trained["distiller"]
    model = distiller.students["q"].model
    assert type(distiller.students["q"].engine).__name__ == "DeepSpeedEngine"
    assert len(quantize.fake_quantized(model)) == 28 and quantize.quantize_of(model) == SCHEME
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir)
    moved = max((p - teacher.get_parameter(n)).abs().max().item() for n, p in model.named_parameters())
    assert moved > 1e-3  # the fake-quantised layers' high-precision weights train (straight-through gradient)
    learned = distiller.students["l"].model
    ptq = quantize.prepare(copy.deepcopy(teacher), LEARNED)  # the scales as initialised: PTQ's, max |w| / 7.5
    scales = {n: p for n, p in learned.named_parameters() if n.endswith("weight_fake_quantizer.scale")}
    assert len(scales) == 28 and all(p.requires_grad for p in scales.values())
    assert max((p - ptq.get_parameter(n)).abs().max().item() for n, p in scales.items()) > 1e-4  # they train


@pytest.mark.slow
def test_the_export_loads_as_low_bit_weights_and_computes_the_fake_quantised_students_logits(trained):
    """The folder: config.json's torchao quantization_config, int4 values in torchao's safetensors layout, the head
    left in high precision. Its logits against the trained fake-quantised student's, same inputs, float32.

    The bound: both forwards compute F.linear on bitwise-equal dequantised weights (the test above) and, for 8da4w,
    the same per-token int8 activations; what may differ is the order of a kernel's float32 sums. A dot product of
    n terms reordered moves by at most n * u * sum|x_i w_i| (u = 2**-24); with n <= 48, 4 layers of 3 matmuls in
    sequence and the head (13 in all), a relative bound of 13 * 48 * u on the logits' scale covers it, 4e-5. A
    wrong scale, group or zero point moves logits by a whole int4 step of a weight (1/15 of its group's range)."""
    path = trained["export"]
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "torchao" and config["modules_to_not_convert"] == ["lm_head"]
    assert config["quant_type"]["default"]["_type"] == "Int8DynamicActivationIntxWeightConfig"
    assert quantize.weight_bytes(path) > 0 and not list(path.glob("*.bin"))  # safetensors only, no pickle
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(loaded.model.layers[0].mlp.down_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
    assert loaded.model.layers[0].mlp.down_proj.weight.qdata.abs().max() <= 8  # int4 values: -8 .. 7
    student = trained["distiller"].students["q"].model.eval()
    ids = random_batches(1, 2, 16, seed=11)[0]["input_ids"]
    with torch.no_grad(), quantize.unpatched_linear():
        want = student(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    bound = 13 * 48 * 2.0**-24 * want.abs().max().item()
    assert (got - want).abs().max().item() <= bound
    assert loaded.lm_head.weight.dtype == torch.float32 and type(loaded.lm_head.weight) is torch.nn.Parameter
    student.train()


@pytest.mark.slow
def test_a_student_with_learned_scales_exports_them(trained):
    """The learned-scale student's folder holds its trained scales (not PTQ's recomputed ones) and computes its
    fake-quantised logits, within the bound derived above."""
    student = trained["distiller"].students["l"].model.eval()
    loaded = AutoModelForCausalLM.from_pretrained(trained["learned_export"]).eval()
    layer = "model.layers.0.mlp.down_proj"
    want_scale = student.get_submodule(layer).weight_fake_quantizer.scale.detach().flatten()
    assert torch.equal(loaded.get_submodule(layer).weight.scale.flatten().float(), want_scale)
    ids = random_batches(1, 2, 16, seed=11)[0]["input_ids"]
    with torch.no_grad(), quantize.unpatched_linear():
        want = student(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert (got - want).abs().max().item() <= 13 * 48 * 2.0**-24 * want.abs().max().item()
    student.train()


@pytest.mark.slow
def test_a_resumed_quantized_run_equals_the_uninterrupted_run(trained, teacher_dir):
    """Resumed from the checkpoint at step 2 in a new Distiller: steps 3 and 4 give the same losses, bit for bit,
    and the same weights (checkpoints hold the weights, and the learned scales as parameters)."""
    resumed = _distiller(teacher_dir, trained["folder"] / "resumed")
    resumed.load(trained["folder"] / "checkpoints" / "step_00000002")
    rest = resumed.train(random_batches(4, 2, 16, seed=3))
    assert rest == trained["records"][2:]
    for student in ("q", "l"):
        want = dict(trained["distiller"].students[student].model.named_parameters())
        for name, param in resumed.students[student].model.named_parameters():
            assert torch.equal(param, want[name]), name


def test_ptq_of_the_teacher_is_the_same_conversion_of_untrained_weights(teacher_dir):
    """The PTQ baseline (``quantize.convert`` of a model without fake quantisers) and the QAT convert of the same
    weights untrained give the same low-bit weights: the baselines differ only by training."""
    spec = QuantizeConfig("int4_weight_only", group_size=GROUP)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir)
    ptq = quantize.convert(teacher, spec)
    qat = quantize.convert(quantize.prepare(copy.deepcopy(teacher), spec), spec)
    for (name, a), (_, b) in zip(ptq.named_parameters(), qat.named_parameters(), strict=True):
        plain = (a.dequantize(), b.dequantize()) if hasattr(a, "qdata") else (a, b)
        assert torch.equal(*plain), name
    assert not quantize.fake_quantized(teacher)  # the original is left as it was


@pytest.mark.slow
def test_the_cli_cuts_a_student_from_its_teacher_trains_it_quantized_and_reports_its_size(tmp_path):
    """init_from_teacher (every other layer) + quantize through scripts/distill.py's run: the cut student is
    fake-quantised, exported as low-bit weights, and report.json gives its bytes on disk."""
    from test_cli import write_texts

    from distill_kit.data.tokenizer import train_tokenizer
    from distill_kit.run import cli

    tokenizer = train_tokenizer(write_texts(tmp_path), vocab_size=300)
    torch.manual_seed(0)
    teacher = tmp_path / "teacher"
    LlamaForCausalLM(llama_config(vocab_size=len(tokenizer))).save_pretrained(teacher)
    tokenizer.save_pretrained(teacher)
    out = tmp_path / "run"
    students = [{"name": "cut", "init_from_teacher": {"every": 2}, "quantize": {"group_size": GROUP}}]
    config = run_config.load(None, [
        f"teacher={teacher}", f"output_dir={out}", f"data.train={tmp_path / 'train.txt'}",
        f"data.heldout={tmp_path / 'heldout.txt'}", "data.block_size=32", "data.max_train_blocks=16",
        "data.max_heldout_blocks=2", "training.max_steps=2", "training.micro_batch_size=2", "eval.every=0",
        "teacher_ds_overrides={zero_optimization.stage: 0}",
        "--students", json.dumps(students)])
    cli.run(config)
    report = json.loads((out / "report.json").read_text())
    record = report["quantized_exports"]["cut"]
    assert record["scheme"] == "int4_weight_only" and record["group_size"] == GROUP
    assert record["weight_bytes"] == quantize.weight_bytes(out / "students" / "cut") > 0
    loaded = AutoModelForCausalLM.from_pretrained(out / "students" / "cut")
    assert loaded.config.num_hidden_layers == 2
    assert type(loaded.model.layers[1].self_attn.o_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
