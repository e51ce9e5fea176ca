"""The preflight section: the fused elementwise kernels checked against their references at the
model's shapes before the sweeps and engine sections rely on them."""

from __future__ import annotations

import argparse
from typing import Any

import torch


def preflight(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    """Each fused elementwise kernel against its reference at the 27B decode shapes; a kernel
    that fails is unregistered (the engine then runs the reference) and the failure recorded."""
    from worker.kernels import ops, reference

    dev, dt = args.device, torch.bfloat16
    t, h, f = args.concurrency, config.hidden_size, config.intermediate_size
    nv, d = config.linear_num_value_heads, config.head_dim
    rot = config.rotary_dim
    angles = torch.outer(torch.arange(4096.0, device=dev), torch.rand(rot // 2, device=dev))
    a_b = torch.randn(t, 2 * nv + 8, device=dev, dtype=dt) * 4
    x, res = torch.randn(t, h, device=dev, dtype=dt), torch.randn(t, h, device=dev, dtype=dt)
    w = torch.randn(h, device=dev, dtype=dt) * 0.1
    qg = torch.randn(t, config.num_attention_heads, 2 * d, device=dev, dtype=dt)
    positions = torch.randint(0, 4096, (t,), device=dev)
    cases: dict[str, tuple[Any, ...]] = {
        "add_rms_norm": (x, res, w, 1e-6, True),
        "silu_mul": (torch.randn(t, 2 * f, device=dev, dtype=dt) * 3,),
        "gdn_gates": (
            a_b[:, :nv],
            a_b[:, nv : 2 * nv],
            torch.rand(nv, device=dev).add(0.5).log(),
            torch.randn(nv, device=dev),
        ),
        "apply_rotary": (qg[..., :d], positions, (angles.cos(), angles.sin()), rot),
        "sigmoid_mul": (torch.randn(t, qg.shape[1] * d, device=dev, dtype=dt), qg[..., d:]),
        # strided heads read in place: the q norm on q_proj's query half, DeltaNet's z gate
        "rms_norm": (qg[..., :d], torch.randn(d, device=dev, dtype=dt) * 0.1, 1e-6, True),
        "gated_rms_norm": (
            torch.randn(t, nv, config.linear_value_head_dim, device=dev, dtype=dt),
            torch.randn(t, nv, 2 * config.linear_value_head_dim, device=dev, dtype=dt)[
                ..., : config.linear_value_head_dim
            ],
            torch.randn(config.linear_value_head_dim, device=dev, dtype=dt),
            1e-6,
        ),
    }
    from worker.models.fp8 import quantize_weight

    gate_up_w, gate_up_s = quantize_weight(torch.randn(2 * f, h, device=dev, dtype=dt) * 0.02)
    cases["linear_silu_mul"] = (x, gate_up_w, gate_up_s, None)
    conv_state = torch.randn(t + 1, config.conv_dim, 3, device=dev, dtype=dt)
    conv_case = (
        torch.randn(t, config.conv_dim, device=dev, dtype=dt),
        torch.randn(config.conv_dim, 4, device=dev, dtype=dt),
        conv_state,
        torch.arange(t, device=dev),
        *cases["gdn_gates"],
    )
    result: dict[str, Any] = {}
    for op, case in cases.items():
        impl = ops.select(op, torch.device(dev), dt)
        try:
            out, ref = impl.fn(*case), getattr(reference, op)(*case)
            outs = out if isinstance(out, tuple) else (out,)
            refs = ref if isinstance(ref, tuple) else (ref,)
            errs = [
                ((o.double() - r.double()).norm() / r.double().norm()).item()
                for o, r in zip(outs, refs, strict=True)
            ]
            ok = all(e < 2e-2 for e in errs)
            result[op] = {"impl": impl.name, "rel_err": errs, "ok": ok}
        except Exception as exc:
            ok = False
            result[op] = {"impl": impl.name, "error": f"{type(exc).__name__}: {exc}"}
        if not ok and op == "linear_silu_mul":  # the two launches, not the slow reference
            from worker.kernels.triton import fp8_gemm

            fp8_gemm.SILU_MUL_TILINGS[(2 * f, h, True)] = None
            result[op]["unfused"] = True
        elif not ok and impl.name != "reference":
            ops.unregister(op, impl.name)
            result[op]["unregistered"] = True
    # the conv update shifts its state in place: each side gets its own copy
    op = "conv_update_with_gates"
    impl = ops.select(op, torch.device(dev), dt)
    try:
        mine = impl.fn(*conv_case[:2], conv_state.clone(), *conv_case[3:])
        theirs = getattr(reference, op)(*conv_case[:2], conv_state.clone(), *conv_case[3:])
        errs = [
            ((o.double() - r.double()).norm() / r.double().norm()).item()
            for o, r in zip(mine, theirs, strict=True)
        ]
        result[op] = {"impl": impl.name, "rel_err": errs, "ok": all(e < 2e-2 for e in errs)}
    except Exception as exc:
        result[op] = {"impl": impl.name, "error": f"{type(exc).__name__}: {exc}", "ok": False}
    if not result[op]["ok"] and impl.name != "reference":
        ops.unregister(op, impl.name)
        result[op]["unregistered"] = True
    return result
