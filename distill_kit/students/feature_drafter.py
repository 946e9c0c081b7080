"""A drafter that reads its teacher's features: EAGLE-3's design (Li et al. 2025) as a student kind.

One decoder layer fed with two things at each position ``s``: the embedding of token ``x_s`` (the teacher's
embedding table, frozen) and a feature standing for the teacher's state at ``s - 1``, the fusion by one linear layer
(``fc``, ``3H -> H``) of the teacher's low, middle and high hidden states there. The layer's output, normed and
passed through the teacher's output head (frozen), predicts ``x_{s+1}``: aligned with the teacher's own logits at
``s``, so every existing loss (forward KL by default) compares them as they stand.

At decoding time only the verified prefix has teacher features. The first draft of a round reads them; each later
draft reads the drafter's own previous output (its hidden state before the final norm) in place of the teacher's,
as EAGLE does. Training-time test (EAGLE-3) trains that use: :meth:`FeatureDrafter.unrolled` runs ``steps`` draft
steps at every position at once, step ``m`` at position ``s`` reading the drafter's step ``m - 1`` output at
``s - 1``, and attending exactly what decoding would let it attend: the teacher-fed keys up to ``s - m + 1`` and its
own chain's keys after them (one attention over the steps' concatenation with that mask). The same unroll gives
greedy speculative decoding's rounds over the target's greedy text (``training/speculative.py``).

The layer is the teacher architecture's own transformers decoder layer (``LlamaDecoderLayer``,
``Qwen2DecoderLayer``, ...): its attention, rotary embedding, norms and MLP are transformers', only the query, key
and value projections read ``2H`` (the normed embedding and the normed feature side by side), as in EAGLE-3; the
residual wiring around them is the few lines of :meth:`FeatureDrafter._layer`. Exported
(:meth:`FeatureDrafter.save_pretrained`) with the weight names and config vLLM's and SGLang's EAGLE-3 drafters read
(``fc``, ``midlayer.*``, ``norm``, ``lm_head``; ``docs/drafters.md`` says what matches and what does not).
"""

from __future__ import annotations

import copy
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_layers(num_layers: int) -> tuple[int, int, int]:
    """The teacher's hidden states read, as indices of transformers' ``hidden_states`` tuple (0 the embeddings,
    ``i`` the output of layer ``i - 1``, i.e. the input of layer ``i``): vLLM's and SGLang's EAGLE-3 default,
    the inputs of layers 2, L // 2 and L - 3 (low, middle, high); clamped for teachers of fewer than 6 layers."""
    return tuple(min(max(i, 1), num_layers) for i in (2, num_layers // 2, num_layers - 3))


@dataclass
class FeatureDrafterOutput:
    """``logits`` ``(B, T, V)``: at position s, the prediction of token s + 1. ``hidden`` ``(B, T, H)``: the
    layer's output before the final norm, the next draft step's feature at s + 1."""

    logits: torch.Tensor
    hidden: torch.Tensor


def _decoder_parts(teacher: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The teacher's base model (with ``embed_tokens``, ``layers``, ``rotary_emb``) and output head."""
    base = getattr(teacher, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        raise ValueError(f"a feature-reading drafter is built from a decoder-only causal LM with model.layers and "
                         f"model.rotary_emb (Llama, Qwen2, Mistral, ...); {type(teacher).__name__} is not one")
    return base, teacher.get_output_embeddings()


class FeatureDrafter(nn.Module):
    """EAGLE-3's drafter on a teacher: ``fc`` (3H -> H), one decoder layer of the teacher's class reading 2H,
    a final norm, and the teacher's embedding table and output head, shared and frozen."""

    reads_teacher_features = True
    """Speculative decoding and the training step hand it the teacher's hidden states (``training/speculative.py``)."""

    def __init__(self, teacher: nn.Module, layers: tuple[int, int, int] | None = None,
                 attn_implementation: str = "sdpa", ttt_steps: int = 1):
        super().__init__()
        self.ttt_steps = ttt_steps
        """Draft steps the training step unrolls (``FeatureDrafterConfig.ttt_steps``; :meth:`forward`'s
        ``draft_steps``)."""
        base, head = _decoder_parts(teacher)
        config = copy.deepcopy(teacher.config)
        config._attn_implementation = attn_implementation
        hidden = config.hidden_size
        self.config = config
        self.layers = tuple(layers) if layers is not None else default_layers(config.num_hidden_layers)
        if len(self.layers) != 3 or not all(0 <= i <= config.num_hidden_layers for i in self.layers):
            raise ValueError(f"feature drafter layers {self.layers}: give three indices of the teacher's hidden "
                             f"states, 0 (embeddings) to {config.num_hidden_layers} (its last layer's output)")
        self.hidden_size = hidden
        self.embed_tokens = base.embed_tokens  # shared with the teacher, frozen
        self.lm_head = head
        for module in (self.embed_tokens, self.lm_head):
            module.requires_grad_(False)
        self.rotary_emb = type(base.rotary_emb)(config=config)
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        layer = type(base.layers[0])(config, layer_idx=0)
        attention = layer.self_attn
        # EAGLE-3: attention reads [embedding, feature], 2H wide, with no q/k/v bias whatever the teacher has (a
        # Qwen2 teacher's layer has them): the layout vLLM's and SGLang's EAGLE-3 Llama drafter load as it is.
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attention, name, nn.Linear(2 * hidden, getattr(attention, name).out_features, bias=False))
        norm = type(layer.input_layernorm)
        layer.hidden_norm = norm(hidden, eps=config.rms_norm_eps)
        self.midlayer = layer
        self.norm = norm(hidden, eps=config.rms_norm_eps)
        self._cache_kw = "cache" if "cache" in inspect.signature(attention.forward).parameters else "past_key_values"
        self.to(dtype=head.weight.dtype, device=head.weight.device)
        self._init_new(config.initializer_range)

    def _init_new(self, std: float) -> None:
        for module in (self.fc, *self.midlayer.modules()):
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    # ---- the forward ---------------------------------------------------------------------------------------

    def fuse(self, hidden_states: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
        """The teacher's low, middle and high hidden states at every position, fused: ``(B, T, H)``."""
        return self.fc(torch.cat([hidden_states[i] for i in self.layers], dim=-1).to(self.fc.weight.dtype))

    def teacher_features(self, hidden_states) -> torch.Tensor:
        """Position s's feature input: the fused teacher state at s - 1 (zeros at position 0, which has none)."""
        fused = self.fuse(hidden_states)
        return torch.cat([torch.zeros_like(fused[:, :1]), fused[:, :-1]], dim=1)

    def _layer(self, embeds: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor,
               mask: torch.Tensor | None, cache: Any = None) -> torch.Tensor:
        """EAGLE-3's residual wiring around the transformers layer's own attention, norms and MLP."""
        layer = self.midlayer
        residual = features
        both = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(features)], dim=-1)
        attended, _ = layer.self_attn(hidden_states=both, position_embeddings=self.rotary_emb(features, position_ids),
                                      attention_mask=mask, **{self._cache_kw: cache})
        hidden = residual + attended
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def _additive(self, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A boolean (Tq, Tk) mask as the additive (1, 1, Tq, Tk) mask transformers' attention functions take."""
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)[None, None]

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor | None = None,
                teacher_hidden_states: Any = None, cache: Any = None, draft_steps: int = 1,
                **_: Any) -> FeatureDrafterOutput | list[FeatureDrafterOutput]:
        """One draft step at every position of ``input_ids`` ``(B, T)``: ``features`` ``(B, T, H)`` (position s's
        stand-in for the teacher at s - 1), or the teacher's ``hidden_states`` tuple to fuse them from. With a
        transformers ``cache`` the positions continue after its length (a decoding step). ``draft_steps`` > 1:
        :meth:`unrolled`'s list of that many steps instead (the training step's training-time test)."""
        if features is None:
            features = self.teacher_features(teacher_hidden_states)
        if draft_steps > 1:
            return self.unrolled(input_ids, steps=draft_steps, features=features)
        past = cache.get_seq_length() if cache is not None else 0
        length = input_ids.shape[1]
        position_ids = torch.arange(past, past + length, device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        mask = None
        if length > 1:
            rows = torch.arange(length, device=input_ids.device)[:, None] + past
            allowed = torch.arange(past + length, device=input_ids.device)[None, :] <= rows
            mask = self._additive(allowed, features.dtype)
        hidden = self._layer(self.embed_tokens(input_ids), features.to(self.fc.weight.dtype), position_ids, mask, cache)
        return FeatureDrafterOutput(self.lm_head(self.norm(hidden)), hidden)

    def unrolled(self, input_ids: torch.Tensor, teacher_hidden_states: Any = None, steps: int = 1,
                 features: torch.Tensor | None = None) -> list[FeatureDrafterOutput]:
        """``steps`` draft steps at every position at once (training-time test): step ``m`` at position ``s`` reads
        token ``x_s`` and the step ``m - 1`` hidden state at ``s - 1`` (step 1: the teacher's), and attends the
        step-1 keys at positions up to ``s - m + 1`` and step ``j``'s key at ``s - m + j`` (2 <= j <= m): what
        draft ``m`` of a round whose verified text ends at ``s - m + 1`` attends at decoding time. One entry a step.
        """
        if features is None:
            features = self.teacher_features(teacher_hidden_states)
        batch, length = input_ids.shape
        device = input_ids.device
        embeds = self.embed_tokens(input_ids)
        position = torch.arange(length, device=device)
        outputs: list[FeatureDrafterOutput] = []
        step_features = [features.to(self.fc.weight.dtype)]
        for m in range(1, steps + 1):
            # Keys: the m steps' inputs side by side (step j at block j - 1); queries: every block (earlier
            # steps' outputs come out the same, their masks being the same), of which the last block is kept.
            q_step = torch.arange(m, device=device).repeat_interleave(length)   # 0-based step of each row
            q_pos = position.repeat(m)
            k_step, k_pos = q_step[None, :], q_pos[None, :]  # keys: the same rows
            s, step = q_pos[:, None], q_step[:, None] + 1        # query position, its 1-based step
            teacher_keys = (k_step == 0) & (k_pos <= s - step + 1)
            chain_keys = (k_step >= 1) & (k_step < step) & (k_pos == s - step + k_step + 1)
            allowed = teacher_keys | chain_keys
            mask = self._additive(allowed, step_features[0].dtype)
            hidden = self._layer(embeds.repeat(1, m, 1), torch.cat(step_features, dim=1),
                                 q_pos[None].expand(batch, -1), mask)[:, -length:]
            outputs.append(FeatureDrafterOutput(self.lm_head(self.norm(hidden)), hidden))
            # Step m + 1 at position s reads step m's output at s - 1 (position 0 reads zeros: nothing before it).
            step_features.append(torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], dim=1))
        return outputs

    # ---- export --------------------------------------------------------------------------------------------

    def eagle3_config(self) -> dict[str, Any]:
        """The config.json of vLLM's and SGLang's EAGLE-3 Llama drafter (``LlamaForCausalLMEagle3``)."""
        c = self.config
        return {"architectures": [EAGLE3_ARCHITECTURE], "model_type": "llama",
                "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                "num_attention_heads": c.num_attention_heads,
                "num_key_value_heads": getattr(c, "num_key_value_heads", c.num_attention_heads),
                "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                "num_hidden_layers": 1, "hidden_act": c.hidden_act, "rms_norm_eps": c.rms_norm_eps,
                "vocab_size": c.vocab_size, "draft_vocab_size": c.vocab_size, "target_hidden_size": c.hidden_size,
                "max_position_embeddings": c.max_position_embeddings,
                "rope_theta": (getattr(c, "rope_parameters", None) or {}).get("rope_theta",
                                                                              getattr(c, "rope_theta", 10000.0)),
                "attention_bias": False, "rope_scaling": self._rope_scaling(),
                "tie_word_embeddings": False, "torch_dtype": str(self.fc.weight.dtype).removeprefix("torch."),
                "eagle_config": {"use_aux_hidden_state": True,
                                 "eagle_aux_hidden_state_layer_ids": list(self.layers)},
                "distill_kit": {"kind": "feature_drafter", "teacher_architecture": c.architectures,
                                "teacher_model_type": c.model_type}}

    def _rope_scaling(self) -> dict[str, Any] | None:
        """The teacher's RoPE scaling (Llama 3.1's ``llama3``, YaRN, ...) in the older ``rope_scaling`` key that
        the servers' Llama configs read; None for plain RoPE."""
        rope = dict(getattr(self.config, "rope_parameters", None) or getattr(self.config, "rope_scaling", None) or {})
        rope.pop("rope_theta", None)
        return rope if rope.get("rope_type", "default") != "default" else None

    def save_pretrained(self, directory: str | Path, tokenizer: Any | None = None) -> Path:
        """A folder in EAGLE-3's layout: ``config.json`` and ``model.safetensors`` with ``fc.weight``,
        ``midlayer.*``, ``norm.weight``, ``lm_head.weight`` and ``embed_tokens.weight`` (the teacher's, so that
        the folder stands alone), and the teacher's tokenizer when given."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        # cloned: a teacher with tied embeddings shares one tensor between embed_tokens and lm_head, and
        # safetensors stores no shared tensors
        state = {name: tensor.detach().cpu().clone().contiguous() for name, tensor in self.state_dict().items()
                 if not name.startswith("rotary_emb.")}
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps(self.eagle3_config(), indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path, teacher: nn.Module) -> FeatureDrafter:
        """The drafter saved by :meth:`save_pretrained`, on ``teacher`` (whose embedding and head it shares);
        safetensors only (nothing in the folder executes)."""
        from safetensors.torch import load_file

        directory = Path(directory)
        config = json.loads((directory / "config.json").read_text())
        drafter = cls(teacher, layers=tuple(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]))
        state = load_file(str(directory / "model.safetensors"))
        own = {k: v for k, v in state.items() if not k.startswith(("embed_tokens.", "lm_head."))}
        missing, unexpected = drafter.load_state_dict(own, strict=False)
        missing = [k for k in missing if not k.startswith(("embed_tokens.", "lm_head.", "rotary_emb."))]
        if missing or unexpected:
            raise ValueError(f"{directory}: not a feature drafter of this teacher (missing {missing}, "
                             f"unexpected {unexpected})")
        return drafter
