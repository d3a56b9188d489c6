"""Replacement operators: what the replaced heads of a layer become.

An operator is any subclass of :class:`ReplacementOperator`, named in recipes by
``class_path``. :meth:`ReplacementOperator.build` returns the mixer module of one layer. A
mixer takes the values of the replaced heads' KV heads ``(B, L, d_in)`` and returns the
replaced heads' outputs ``(B, L, d_out)`` in their original head order. Its call signature::

    out = mixer(x)                                   # training / full forward
    out, state = mixer(x, *state, return_states=True)  # prefill or continue from a state
    out, *state = mixer.step(x, *state)              # one decode token

``state`` is a tuple of tensors whose size does not grow with the sequence. When a chunk
holds padding (a left-padded batch), the two forward calls also get ``mask=`` (B, L), 1 for
real tokens; pad tokens must leave the state untouched. Unpadded input never sends a mask.
``mixer.state_bytes(batch_size, dtype)`` gives the bytes of one state (cache accounting).
What else the pipeline may ask of a mixer (calibration before attention transfer, switching its
state off for the "state off" evaluations) are the optional hooks of
:class:`rfkit.models.mixer.ReplacementMixer`; subclass it for their defaults.

What ``x`` holds is the operator's :attr:`ReplacementOperator.inputs`: ``"values"`` (the default,
RecurFormer's choice) is the replaced heads' KV-head values only; ``"qkv"`` is their rotated
queries, keys and values concatenated, ``(B, L, Hq*hd + 2*Hkv*hd)``, for operators that keep
attending (:class:`SlidingWindowOperator`, :class:`SinkRecentOperator`). ``qkv`` operators are
built with ``build(d_in, d_out, layer_idx, kv_for_query=..., head_dim=..., scaling=...)``, and
the converted layer keeps the replaced heads' pretrained query and key projections for them; it
calls their mixer with the split triple instead of the packed tensor: ``mixer((q, k, v), *state,
...)`` with queries ``(B, Hq, L, hd)`` and keys and values ``(B, Hkv, L, hd)``, rotated, and
``mixer.step_qkv(q, k, v, *state)`` for a decode token.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

import torch
from torch import nn

from rfkit.classpath import class_path, public_path
from rfkit.errors import RFKitError
from rfkit.validate import INTEGER_NOT_ALLOWED, fraction, in_range, one_of, positive_int


class OperatorError(RFKitError):
    """A bad operator setting. One line for the user, naming the field."""


class ReplacementOperator(ABC):
    """Base class for operators."""

    #: what the mixer reads: ``"values"`` or ``"qkv"`` (see the module docstring)
    inputs: str = "values"
    #: whether the mixer has weights to learn (``rfkit fit`` / attention transfer train them)
    trainable: bool = True

    @abstractmethod
    def build(self, d_in: int, d_out: int, layer_idx: int) -> nn.Module:
        """Implemented by every subclass."""

    def check_layers(self, replaced_layers: list[int]) -> None:
        """Refuse (:class:`OperatorError`, naming the field) a setting that names decoder layers
        other than ``replaced_layers``, the layers that replace at least one head. Called once
        per conversion, before any layer is built; the default accepts every selection."""

    def init_from_attention(self, mixer: nn.Module, attention: nn.Module, layer) -> None:
        """Initialise ``mixer`` from the original ``attention`` module it replaces (``init:
        from_attention``). ``layer`` is the :class:`~rfkit.models.modeling.RecurFormerAttention` that holds
        it (head indices, head_dim). Operators without such an initialisation say so."""
        raise OperatorError(f"model.init: from_attention is not supported by {type(self).__name__}; use init: random")

    def init_args(self) -> dict:
        """The keyword arguments that rebuild this operator (saved in converted model configs)."""
        return {}

    def to_dict(self) -> dict:
        return {"class_path": class_path(type(self)), "init_args": self.init_args()}

    @staticmethod
    def from_dict(spec: dict) -> "ReplacementOperator":
        module_name, _, cls_name = spec["class_path"].rpartition(".")
        builtin = globals().get(cls_name) if public_path(spec["class_path"]) == f"rfkit.operators.{cls_name}" else None
        # a built-in operator is this module's own class (so an exported model folder, which ships
        # this module without rfkit, rebuilds it too); a plugin's is imported by its path
        cls = builtin if isinstance(builtin, type) else getattr(importlib.import_module(module_name), cls_name)
        if not (isinstance(cls, type) and issubclass(cls, ReplacementOperator)):
            raise OperatorError(f"model.operator: {spec['class_path']} is not a ReplacementOperator subclass")
        return cls(**spec.get("init_args", {}))


def _positive_int(name: str, value, minimum: int = 1, multiple_of: int = 1, message: str = INTEGER_NOT_ALLOWED) -> int:
    return positive_int(f"model.operator.{name}", value, minimum, multiple_of=multiple_of, error=OperatorError, message=message)


class MambaOperator(ReplacementOperator):
    """One Mamba block per layer, fed with the values of all the layer's replaced heads.

    The paper's settings are d_state 16, d_conv 4, expand 2, dt_rank 256. ``dt_rank="auto"``
    uses ceil(d_in / 16), which suits small blocks (one 64-wide KV group gives 4).

    Args:
        d_state: SSM state size per channel (N).
        d_conv: Width of the causal depthwise convolution.
        expand: Inner width multiplier: d_inner = expand * d_in.
        dt_rank: Rank of the time-step projection, or "auto".
        use_fast_path: "auto" uses mamba-ssm's fused CUDA kernels when installed and on CUDA,
            "always" requires them, "never" uses the pure-PyTorch scan.
        zero_init_output: Start with ``out_proj`` at zero, so the converted model begins as the
            original with the replaced heads silenced rather than with random noise in their
            place; training then grows the block's contribution. ``false`` is the paper's
            plain random initialisation.
    """

    def __init__(
        self,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        dt_rank: int | str = "auto",
        use_fast_path: str = "auto",
        zero_init_output: bool = True,
    ):
        self.d_state = _positive_int("d_state", d_state)
        self.d_conv = _positive_int("d_conv", d_conv)
        self.expand = _positive_int("expand", expand)
        if dt_rank != "auto":
            _positive_int("dt_rank", dt_rank)
        self.dt_rank = dt_rank
        self.use_fast_path = one_of("model.operator.use_fast_path", use_fast_path, ("auto", "always", "never"), error=OperatorError)
        self.zero_init_output = bool(zero_init_output)

    def init_args(self) -> dict:
        return {
            "d_state": self.d_state,
            "d_conv": self.d_conv,
            "expand": self.expand,
            "dt_rank": self.dt_rank,
            "use_fast_path": self.use_fast_path,
            "zero_init_output": self.zero_init_output,
        }

    def build(self, d_in: int, d_out: int, layer_idx: int) -> nn.Module:
        from rfkit.models.mamba import MambaBlock

        args = self.init_args()
        zero = args.pop("zero_init_output")
        block = MambaBlock(d_in, d_out, layer_idx=layer_idx, **args)
        if zero:
            nn.init.zeros_(block.out_proj.weight)
        return block

    @torch.no_grad()
    def init_from_attention(self, mixer: nn.Module, attention: nn.Module, layer) -> None:
        """Start the block as a gated copy of the values, with B and C reading the keys and queries.

        - ``in_proj`` (x half): channel pairs (+v, -v) for every value channel, so that
          ``silu(v) - silu(-v) = v`` passes the values through the block's nonlinearity; the
          remaining channels (expand > 2) keep their random initialisation. The z half (gate)
          stays random.
        - ``conv1d``: a unit tap on the current token for those channels, zero bias.
        - ``x_proj`` (B and C rows): the attention score of a replaced query head is
          ``q_i . k_j``. Through the least-squares maps ``M_q = W_Q W_V^+`` and
          ``M_k = W_K W_V^+`` (queries and keys predicted from the values this block sees),
          the score is ``v_i^T G v_j`` with ``G = M_q^T M_k`` (averaged over the group's
          replaced query heads). The top singular directions of ``G``, split evenly over the
          block's KV groups, become C (query side) and B (key side).
        - ``out_proj``: every replaced query head reads its KV group's value channel pairs
          (+1 / -1), so the block starts close to handing each head its group's values.
        """
        hd = layer.head_dim
        kv_heads, heads = layer.mixer_kv_heads, layer.replaced_heads
        d_in, d_inner, n_state = mixer.d_in, mixer.d_inner, mixer.d_state
        if d_inner < 2 * d_in:
            raise OperatorError("model.init: from_attention needs model.operator.init_args.expand >= 2")
        w_in = mixer.in_proj.weight  # (2 * d_inner, d_in)
        eye = torch.eye(d_in, dtype=w_in.dtype, device=w_in.device)
        w_in[:d_in] = eye
        w_in[d_in : 2 * d_in] = -eye
        conv = mixer.conv1d.weight  # (d_inner, 1, d_conv)
        conv[: 2 * d_in] = 0
        conv[: 2 * d_in, 0, -1] = 1
        if mixer.conv1d.bias is not None:
            mixer.conv1d.bias[: 2 * d_in] = 0

        # B and C from the query-key bilinear form seen through the values.
        from rfkit.models.layout import AttentionLayout

        kv_of = AttentionLayout.from_config(layer.config).kv_head_of
        group_of = {g: [h for h in heads if kv_of(h) == g] for g in kv_heads}
        per_group = max(1, n_state // len(kv_heads))
        w_v = attention.v_proj.weight.float()
        w_q = attention.q_proj.weight.float()
        w_k = attention.k_proj.weight.float()
        x_proj = mixer.x_proj.weight  # (dt_rank + 2N, d_inner)
        b_rows = x_proj[mixer.dt_rank : mixer.dt_rank + n_state]
        c_rows = x_proj[mixer.dt_rank + n_state :]
        b_rows.zero_()
        c_rows.zero_()
        for slot, g in enumerate(kv_heads):
            first = slot * per_group
            count = min(per_group, n_state - first)
            if count <= 0:
                break
            pinv = torch.linalg.pinv(w_v[g * hd : (g + 1) * hd])  # (hidden, hd)
            m_k = w_k[g * hd : (g + 1) * hd] @ pinv  # (hd, hd)
            gram = torch.zeros(hd, hd, dtype=torch.float32, device=w_v.device)  # beside the weights (a GPU in fit)
            for h in group_of[g]:
                m_q = w_q[h * hd : (h + 1) * hd] @ pinv
                gram += m_q.T @ m_k / len(group_of[g])
            u, s, vh = torch.linalg.svd(gram * hd**-0.5)
            root = s[:count].sqrt()
            cols = slice(slot * hd, (slot + 1) * hd)  # the +v channels of this group
            c_rows[first : first + count, cols] = (u[:, :count] * root).T.to(x_proj.dtype)
            b_rows[first : first + count, cols] = (vh[:count].T * root).T.to(x_proj.dtype)

        # out_proj: each replaced head reads its group's (+v, -v) channels.
        w_out = mixer.out_proj.weight  # (d_out, d_inner)
        w_out.zero_()
        eye_hd = torch.eye(hd, dtype=w_out.dtype, device=w_out.device)
        for row, h in enumerate(heads):
            slot = kv_heads.index(kv_of(h))
            rows = slice(row * hd, (row + 1) * hd)
            w_out[rows, slot * hd : (slot + 1) * hd] = eye_hd
            w_out[rows, d_in + slot * hd : d_in + (slot + 1) * hd] = -eye_hd


class SlidingWindowOperator(ReplacementOperator):
    """Replaced heads attend to the last ``window`` tokens only (RazorAttention's treatment of
    non-retrieval heads): their cache is a constant ``window`` tokens instead of the whole
    sequence. No new weights; the heads keep their pretrained projections.

    Args:
        window: Tokens each replaced head sees, the current one included.
    """

    inputs = "qkv"
    trainable = False
    sink = 0

    def __init__(self, window: int = 64):
        self.window = _positive_int("window", window)

    def init_args(self) -> dict:
        return {"window": self.window}

    def build(self, d_in: int, d_out: int, layer_idx: int, kv_for_query=None, head_dim=None, scaling=None) -> nn.Module:
        if kv_for_query is None or head_dim is None:
            raise OperatorError(f"{type(self).__name__} reads queries and keys: build it through a converted layer")
        block = self.make_block(kv_for_query, head_dim, scaling)
        if (block.d_in, block.d_out) != (d_in, d_out):
            raise OperatorError(f"{type(self).__name__}: widths ({d_in}, {d_out}) do not match {len(kv_for_query)} heads of {head_dim}")
        return block

    def make_block(self, kv_for_query: list[int], head_dim: int, scaling: float | None) -> nn.Module:
        from rfkit.models.window import WindowAttention

        return WindowAttention(kv_for_query, head_dim, window=self.window, sink=self.sink, scaling=scaling)


class SinkRecentOperator(SlidingWindowOperator):
    """Replaced heads attend to the first ``sink`` tokens and the last ``window`` tokens
    (StreamingLLM, DuoAttention's streaming heads). ``sink=4, window=16`` holds exactly as many
    cache bytes as the default Mamba block (d_state 16, d_conv 4, expand 2), so the two can be
    compared at matched cache size.

    Args:
        sink: Leading tokens always kept (attention sinks).
        window: Recent tokens kept, the current one included.
    """

    def __init__(self, sink: int = 4, window: int = 60):
        super().__init__(window)
        self.sink = _positive_int("sink", sink, minimum=0)

    def init_args(self) -> dict:
        return {"sink": self.sink, "window": self.window}



class HybridOperator(SinkRecentOperator):
    """Replaced heads keep exact softmax attention over ``sink`` first and ``window`` recent tokens
    and add a learned linear-attention state for the tokens that left the window, under the same
    softmax normaliser (:class:`rfkit.models.hybrid.HybridWindowAttention`). The state's gate starts
    closed, so the freshly converted model *is* the training-free ``SinkRecentOperator(sink,
    window)`` model; attention transfer and distillation then train the feature maps and gates.

    Cache: the sink + window K/V plus ``feature_dim * (head_dim + 1)`` numbers per replaced KV
    head. With head_dim 64, ``feature_dim=16`` costs about 8 tokens of K/V: ``sink=4, window=56,
    feature_dim=16`` holds the bytes of ``sink_recent(sink=4, window=64)`` (+64 bytes), and
    ``sink=4, window=8, feature_dim=16`` those of the default Mamba block.

    Args:
        sink: Leading tokens attended exactly.
        window: Recent tokens attended exactly, the current one included.
        feature_dim: Width of the feature map (even, >= 2).
        window_dropout: Probability that a training forward shortens the window (to between
            ``window // 4`` and ``window``), so the state must learn to carry what the window
            drops. 0 turns it off.
        decay_horizon: Initial horizon ``H`` (tokens) of a learned per-KV-head decay of the state:
            a token that left the window ``a`` tokens ago weighs ``exp(-a / H)``, so the state
            holds about the last ``H`` evicted tokens at any length and reads the same at 8k as
            at the training length. ``None`` (the default of models saved before it existed):
            no decay, every old token weighs the same.
        sharpness: ``tau >= 1``: the state's weight against the window is ``g e^{-tau m}``,
            ``m`` the window's best score (:mod:`rfkit.models.hybrid`). 1 (the default) keeps the
            softmax's own scale; above 1 a strong match in the window (the sentence a question
            asks about) leaves the state less weight. Not learned: set on a saved model it changes
            the outputs without training (``benchmarks/sharpen.py``).
        stateless_layers: Decoder layers whose replaced heads get no state: they keep the exact
            sink + window alone (the :class:`SinkRecentOperator` block, nothing to train), the
            other layers the hybrid. For a layer whose state turns the model away from what the
            window quotes (docs/comparing.md, "A sharper state"). Each must be a layer that
            replaces heads. None or empty (the default): every layer has its state.
    """

    trainable = True

    def __init__(
        self, sink: int = 4, window: int = 56, feature_dim: int = 16, window_dropout: float = 0.5,
        decay_horizon: float | None = None, sharpness: float = 1.0, stateless_layers: list[int] | None = None,
    ):  # fmt: skip
        super().__init__(sink=sink, window=window)
        if stateless_layers is None:
            stateless_layers = []
        if not isinstance(stateless_layers, (list, tuple)):
            raise OperatorError(f"model.operator.stateless_layers: {stateless_layers!r} is not allowed; must be a list of decoder layer numbers >= 0")
        layers = [_positive_int("stateless_layers", i, minimum=0) for i in stateless_layers]
        self.stateless_layers = sorted(set(layers))
        even = "{field}: {value!r} is not allowed; must be an even integer >= {minimum}"
        self.feature_dim = _positive_int("feature_dim", feature_dim, minimum=2, multiple_of=2, message=even)
        self.window_dropout = float(fraction("model.operator.window_dropout", window_dropout, error=OperatorError))
        in_range("model.operator.decay_horizon", decay_horizon, 1, finite=True, optional=True, error=OperatorError)
        self.decay_horizon = None if decay_horizon is None else float(decay_horizon)
        self.sharpness = float(in_range("model.operator.sharpness", sharpness, 1, finite=True, error=OperatorError))

    def init_args(self) -> dict:
        args = {**super().init_args(), "feature_dim": self.feature_dim, "window_dropout": self.window_dropout}
        if self.decay_horizon is not None:  # absent when off: old configs and new ones read alike
            args["decay_horizon"] = self.decay_horizon
        if self.sharpness != 1.0:  # likewise
            args["sharpness"] = self.sharpness
        if self.stateless_layers:  # likewise
            args["stateless_layers"] = list(self.stateless_layers)
        return args

    def check_layers(self, replaced_layers: list[int]) -> None:
        missing = sorted(set(self.stateless_layers) - set(replaced_layers))
        if missing:
            allowed = ", ".join(map(str, replaced_layers)) or "none (no layer replaces a head)"
            raise OperatorError(
                f"model.operator.stateless_layers: layer {missing[0]} replaces no head, so it has no state to leave out; allowed: {allowed}"
            )

    def build(self, d_in: int, d_out: int, layer_idx: int, kv_for_query=None, head_dim=None, scaling=None) -> nn.Module:
        if layer_idx in self.stateless_layers:  # the training-free block: sink + window, no state
            return SinkRecentOperator(self.sink, self.window).build(d_in, d_out, layer_idx, kv_for_query, head_dim, scaling)
        return super().build(d_in, d_out, layer_idx, kv_for_query, head_dim, scaling)

    def make_block(self, kv_for_query: list[int], head_dim: int, scaling: float | None) -> nn.Module:
        from rfkit.models.hybrid import HybridWindowAttention

        return HybridWindowAttention(
            kv_for_query, head_dim, window=self.window, sink=self.sink, scaling=scaling,
            feature_dim=self.feature_dim, window_dropout=self.window_dropout, decay_horizon=self.decay_horizon,
            sharpness=self.sharpness,
        )  # fmt: skip


class HybridMambaOperator(SinkRecentOperator):
    """Replaced heads keep exact softmax attention over ``sink`` first and ``window`` recent tokens
    and add the paper's Mamba block as the state of the tokens that left the window: a selective
    state space per replaced KV head, fed the evicted tokens' values, with ``B`` and ``C`` read
    from their rotated keys and the query through a learned projection and a data-dependent step
    size (:class:`rfkit.models.hybrid_mamba.HybridMambaAttention`). Its gate starts closed, so the
    freshly converted model *is* the training-free ``SinkRecentOperator(sink, window)`` model;
    calibration (attention transfer) sets the projection from the keys and fits the gates, then
    transfer and distillation train the state.

    Cache: the sink + window K/V plus ``state_dim * head_dim`` numbers per replaced KV head. With
    head_dim 64, ``state_dim=16`` is 1,024 numbers, the K/V of 8 tokens: ``sink=4, window=56,
    state_dim=16`` holds exactly the bytes of ``sink_recent(sink=4, window=64)`` (and of
    ``hybrid(sink=4, window=56, feature_dim=16)`` less 64 bytes).

    Args:
        sink: Leading tokens attended exactly.
        window: Recent tokens attended exactly, the current one included.
        state_dim: State size ``N`` per KV head, at most the head dim.
        window_dropout: Probability that a training forward shortens the window (to between
            ``window // 4`` and ``window``), so the state must learn to carry what the window
            drops. 0 turns it off.
        window_gain: Learn a gain per query head on the window's output (starting at 1, fitted
            with the gates by calibration). With ``sink=0, window=1`` the window is the current
            token's value and the gain is Mamba's skip ``D``: the block is then a selective state
            space started from the heads' query, key and value projections (MambaInLlama's
            mapping; ``sink=0, window=1, state_dim=38, window_gain=true`` holds the float32 bytes
            of ``MambaOperator``'s default block per KV head: docs/mamba_recipe.md).
    """

    trainable = True

    def __init__(
        self, sink: int = 4, window: int = 56, state_dim: int = 16, window_dropout: float = 0.5, window_gain: bool = False,
    ):  # fmt: skip
        super().__init__(sink=sink, window=window)
        self.state_dim = _positive_int("state_dim", state_dim)
        self.window_dropout = float(fraction("model.operator.window_dropout", window_dropout, error=OperatorError))
        if not isinstance(window_gain, bool):
            raise OperatorError(f"model.operator.window_gain: {window_gain!r} is not allowed; must be true or false")
        self.window_gain = window_gain

    def init_args(self) -> dict:
        args = {**super().init_args(), "state_dim": self.state_dim, "window_dropout": self.window_dropout}
        if self.window_gain:  # absent when off: configs saved before it existed read alike
            args["window_gain"] = True
        return args

    def make_block(self, kv_for_query: list[int], head_dim: int, scaling: float | None) -> nn.Module:
        from rfkit.models.hybrid_mamba import HybridMambaAttention

        if self.state_dim > head_dim:
            message = f"{self.state_dim} is not allowed; must be <= the head dim ({head_dim})"
            raise OperatorError(f"model.operator.state_dim: {message}")
        return HybridMambaAttention(
            kv_for_query, head_dim, window=self.window, sink=self.sink, scaling=scaling,
            state_dim=self.state_dim, window_dropout=self.window_dropout, window_gain=self.window_gain,
        )  # fmt: skip
