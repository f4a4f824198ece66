"""The precision-aware Adam without Transformer Engine: bf16 weights and their fp32 masters, moments in fp32 or bf16.

`PrecisionAwareAdam`: the interface of TE's FusedAdam that megatron-core's distributed optimizer calls with
`use_precision_aware_optimizer` (megatron_patches.precision_aware_adam builds it where TE is absent). Each step
rebuilds the fp32 master (`master_from_remainder`), runs torch's single-tensor AdamW ops on it (the CPU path of
torch.optim.AdamW, megatron-core's fp32-master optimizer here) and stores the bf16 weight and int16 remainder
(`store_master`), a chunk at a time into preallocated scratch. Reasons: docs/DESIGN.md, "Precision-aware optimizer".
"""

from __future__ import annotations

import sys

import torch

assert sys.byteorder == "little", "the remainder is the low 16-bit half of an fp32 master"

REMAINDER_MAX = 2**15 - 1  # int16
STEP_CHUNK = 1 << 23  # elements per op: large (each op is a kernel launch or a parallel region), 136 MiB of scratch
STEP_TEMPORARY_BYTES = 17 * STEP_CHUNK  # fp32 master, moments, gradient then denominator then the split's int32s; bool


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `master` -> (bf16 weight: its round to nearest even, int16 remainder: master bits - weight bits << 16).
    65537 fp32 values round to an even weight, an int16 holds 65536: the tie rounded down (remainder 2**15) is stored
    as 2**15 - 1, the master one fp32 ulp nearer the weight."""
    weight = master.bfloat16()
    diff = master.view(torch.int32) - (weight.view(torch.int16).to(torch.int32) << 16)  # int32 wraps: [-2**15, 2**15]
    return weight, diff.clamp_max_(REMAINDER_MAX).to(torch.int16)


def master_from_remainder(weight: torch.Tensor, remainder: torch.Tensor, out=None) -> torch.Tensor:
    """bf16 `weight` + int16 `remainder` -> the fp32 master: bits (weight bits << 16) + remainder in int32, TE's
    reconstruction (a negative remainder borrows one from the high half)."""
    if out is None:
        out = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    out.copy_(weight)  # exact: the fp32 bits are the bf16 bits << 16
    out.view(torch.int32).add_(remainder)  # int32 wraps
    return out


def store_master(master: torch.Tensor, weight: torch.Tensor, remainder: torch.Tensor, scratch=None) -> None:
    """`split_master(master)` written into `weight` and `remainder` (of `master`'s shape): the master's low half but
    at the ties; `scratch`: (int32, bool) tensors of that shape, else allocated."""
    bits = master.view(torch.int32)
    weight.copy_(master)
    remainder.copy_(bits)  # int32 -> int16 keeps the low half
    low = torch.bitwise_and(bits, 0x1FFFF, out=None if scratch is None else scratch[0])
    tie_down = torch.eq(low, 0x8000, out=None if scratch is None else scratch[1])  # low half 0x8000, even weight
    remainder.sub_(tie_down.view(torch.int8))  # rounded down: 0x8000 - 1 wraps to 0x7FFF


class PrecisionAwareAdam(torch.optim.Optimizer):
    """AdamW over bf16 or fp32 parameter shards. State per p: `exp_avg`, `exp_avg_sq` (in their dtypes), `step`
    (torch's fp32 0-d), with master_weights `master_param` (bf16 p: int16 remainder or fp32 master; fp32 p: p)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, adam_w_mode=True,
                 capturable=False, master_weights=False, master_weight_dtype=torch.float32,
                 exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32, use_decoupled_grad=False,
                 store_param_remainders=False, bias_correction=True):  # fmt: skip
        moments = (torch.float32, torch.bfloat16)
        if not adam_w_mode or capturable or not bias_correction or master_weight_dtype != torch.float32:
            raise ValueError("PrecisionAwareAdam: AdamW with bias correction, fp32 master weights, not capturable")
        if exp_avg_dtype not in moments or exp_avg_sq_dtype not in moments:
            raise ValueError(f"PrecisionAwareAdam: moments in {moments}, not {exp_avg_dtype} / {exp_avg_sq_dtype}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.master_weights = master_weights
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = store_param_remainders and master_weights
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": master_weight_dtype}  # fmt: skip
        self._scratch: dict[str, torch.Tensor] = {}

    def _remainders(self, param) -> bool:
        return self.store_param_remainders and param.dtype == torch.bfloat16

    def initialize_state(self, param, store_param_remainders=None) -> None:
        """Zero moments and step; the master from the bf16 weight (remainder 0, or its fp32 value)."""
        state = self.state[param]
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(param, dtype=self.name_to_dtype_map["exp_avg"])
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.name_to_dtype_map["exp_avg_sq"])
        if self.master_weights and param.dtype == torch.bfloat16:
            keep = self._remainders(param) if store_param_remainders is None else store_param_remainders
            state["master_param"] = torch.zeros_like(param, dtype=torch.int16) if keep else param.detach().float()
        elif self.master_weights:  # an fp32 param is its own master (megatron-core saves every param's master_param)
            state["master_param"] = param.detach()

    def master(self, param) -> torch.Tensor:
        """The fp32 master of `param`: rebuilt (a new tensor), the state's fp32 master, or the fp32 param itself."""
        m = self.state[param].get("master_param")
        if m is None:
            return param.detach()
        return master_from_remainder(param.detach(), m) if m.dtype == torch.int16 else m

    def get_unscaled_state(self, param, state_name: str) -> torch.Tensor:
        """A state tensor as megatron-core saves it: moments in fp32, the master as stored (int16 or fp32)."""
        v = self.state[param][state_name]
        return v.float() if state_name in ("exp_avg", "exp_avg_sq") else v

    @torch.no_grad()
    def set_scaled_state(self, param, state_name: str, unscaled_state: torch.Tensor) -> None:
        """Store a saved state tensor: moments cast to their dtype; a master given as int16 remainders (of `param`'s
        bf16 weight) or as fp32 values, converted to what this optimizer keeps."""
        state = self.state[param]
        if not state:
            self.initialize_state(param)
        if state_name != "master_param":
            state[state_name].copy_(unscaled_state)
            return
        kept = state["master_param"]
        if unscaled_state.dtype == kept.dtype:
            kept.copy_(unscaled_state)
        elif kept.dtype == torch.int16:  # an fp32 master: its bf16 weight is the loaded param
            kept.copy_(split_master(unscaled_state.float())[1])
        else:
            kept.copy_(master_from_remainder(param.detach(), unscaled_state))

    def state_dict(self):
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        sd["state"] = {i: {k: self.get_unscaled_state(params[i], k) for k in s} for i, s in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict) -> None:
        """torch's load (which casts floating state to the param's dtype), then every tensor set as saved."""
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, saved in state_dict["state"].items():
            self.state[params[i]] = {}
            for k, v in saved.items():
                self.set_scaled_state(params[i], k, v if k == "master_param" or k == "step" else v.float())

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
                if self.use_decoupled_grad:
                    p.decoupled_grad = None

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step per tensor, in chunks of STEP_CHUNK elements (`_update`)."""
        assert closure is None
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    self.initialize_state(p)
                g = getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad
                if g is None:
                    continue
                s = self.state[p]
                s["step"] += 1  # torch's fp32 count, read as a Python float as torch's single-tensor AdamW reads it
                step = s["step"].item()
                kept = s.get("master_param")
                for i in range(0, p.numel(), STEP_CHUNK):  # elementwise: the chunks bound the temporaries
                    chunk = slice(i, i + STEP_CHUNK)
                    self._update(*[None if t is None else t.view(-1)[chunk]
                                   for t in (p, g, s["exp_avg"], s["exp_avg_sq"], kept)], step, group)  # fmt: skip

    def _buffer(self, name: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Scratch tensor `name`: STEP_CHUNK elements of `dtype` on `like`'s device, its first numel; kept between
        steps (fresh pages each step cost the CPU more than an op)."""
        buf = self._scratch.get(name)
        if buf is None or buf.device != like.device:
            buf = self._scratch[name] = torch.empty(STEP_CHUNK, dtype=dtype, device=like.device)
        return buf[: like.numel()]

    def _update(self, p, g, exp_avg, exp_avg_sq, kept, step: float, group) -> None:
        """torch's single-tensor AdamW (torch.optim.adam._single_tensor_adam, decoupled weight decay: its ops, in its
        order, with its Python-float constants) on one chunk's fp32 master, then the weight and remainder stored."""
        beta1, beta2 = group["betas"]
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]

        def fp32(name, t):  # `t` in fp32: itself, or its copy in the scratch buffer `name`
            return t if t.dtype == torch.float32 else self._buffer(name, t, torch.float32).copy_(t)

        if kept is None:
            master = p
        elif kept.dtype == torch.int16:
            master = master_from_remainder(p, kept, out=self._buffer("master", p, torch.float32))
        else:
            master = kept
        grad = fp32("denom", g)  # the denominator overwrites it once the moments have it
        m, v = fp32("exp_avg", exp_avg), fp32("exp_avg_sq", exp_avg_sq)
        if weight_decay != 0:
            master.mul_(1 - lr * weight_decay)
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1**step)
        denom = torch.sqrt(v, out=self._buffer("denom", p, torch.float32))
        denom.div_((1 - beta2**step) ** 0.5).add_(eps)
        master.addcdiv_(m, denom, value=-step_size)
        for state, value in ((exp_avg, m), (exp_avg_sq, v)):
            if state is not value:
                state.copy_(value)
        if kept is not None and kept.dtype == torch.int16:
            low = self._buffer("denom", p, torch.float32).view(torch.int32)  # the denominator is spent
            store_master(master, p, kept, (low, self._buffer("tie", p, torch.bool)))
        elif master.dtype != p.dtype:  # a kept fp32 master of a bf16 weight
            p.copy_(master)
