"""``dtarl export CHECKPOINT --hf OUT [--adapter DIR] [--step N] [--force] [--dtype D]``:
a saved training step as a Hugging Face checkpoint (``config.json`` + safetensors).

A ``model.lora`` run's checkpoint holds only its adapters: ``--hf`` writes the base
with the adapters merged (W + (alpha/r) A@B), ``--adapter`` a PEFT adapter directory
(``adapter_config.json`` + ``adapter_model.safetensors``, ``dtarl.lora.peft``) that
``peft.PeftModel.from_pretrained`` loads onto the base; either or both. The base is
rebuilt from the config and must be the one the adapters were trained on (its
checksum, recorded in the step's host record).

CHECKPOINT is a run's ``out_dir``, its ``checkpoints/`` directory, or one step's
directory; without ``--step`` the latest step is exported (a step directory names
its own). The model, optimizers and checkpoint structure are rebuilt from the
config saved in the step's metadata (a ``Trainer`` built from it, as a resume
does; a run from ``model.hf_path`` needs that directory to still exist), the
step is restored through ``CheckpointManager.restore_state`` and the policy is written
with ``save_hf`` (atomic: a temporary directory renamed into place), plus the
run's tokenizer files when its tokenizer came from a HF directory. The step is
verified against its manifest first (``dtarl.rl.integrity``): a corrupt step is
refused, and so are parameters holding NaN or inf. An existing non-empty OUT is
refused unless ``--force``, and even then only when a previous ``dtarl export``
made it (its ``EXPORT_MARKER`` file): ``--force`` never replaces the run's
directory, its checkpoints, the current directory, or a directory holding them.

``dtarl.cli`` adds it with ``register(subparsers)``. Standalone:
``python -m dtarl.commands.export CHECKPOINT --hf OUT``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

import jax
from flax import nnx

from dtarl.lora.peft import save_peft
from dtarl.model.hf import EXPORT_MARKER, SAVE_DTYPES, save_hf, tokenizer_files
from dtarl.rl import integrity
from dtarl.rl.checkpoint import CheckpointError, CheckpointManager, leaf_names
from dtarl.rl.config import ExportSection, LoggingSection, TrainerConfig, from_dict
from dtarl.rl.state import HostRecord
from dtarl.rl.trainer import Trainer


class ExportError(ValueError):
    """``dtarl export`` cannot run; the message names the path or step at fault."""


def locate(path: str | os.PathLike) -> tuple[CheckpointManager, int | None]:
    """(manager of the checkpoints directory, the step a step directory names or None)."""
    given = os.fspath(path)
    p = os.path.abspath(given)
    if not os.path.isdir(p):
        raise ExportError(
            f"{given}: no such directory (expected a run's out_dir, its "
            "checkpoints/ directory or a step directory)"
        )
    run_ckpts = os.path.join(p, "checkpoints")
    if os.path.isdir(run_ckpts):  # a run's out_dir
        mgr = CheckpointManager(run_ckpts)
        if mgr.steps():
            return mgr, None
    parent = os.path.dirname(p)
    if parent != p:  # a step directory: its parent's manager knows it by path
        up = CheckpointManager(parent)
        for s in up.steps():
            if os.path.abspath(up.path(s)) == p:
                return up, s
    mgr = CheckpointManager(p)  # a checkpoints/ directory
    if mgr.steps():
        return mgr, None
    raise ExportError(
        f"{given}: no checkpoint found; looked for complete saved steps (a step directory "
        f"with its meta.json) in {run_ckpts}, in {p} itself, and for {p} being one of them"
    )


def _within(child: str, parent: str) -> bool:
    child, parent = os.path.realpath(child), os.path.realpath(parent)
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def _check_writable(out: str, flag: str = "--hf") -> None:
    """Creates (and removes) a probe next to ``out``: an unwritable target fails now, in
    one line, not after the model is rebuilt."""
    parent = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".dtarl-export-probe-", dir=parent))
    except OSError as e:
        raise ExportError(f"{flag} {out}: cannot be written ({e.strerror or e})") from None


def _check_out(out: str, ckpt_dir: str, force: bool, flag: str = "--hf") -> None:
    protected = [
        ("the checkpoints being exported", ckpt_dir),
        ("the run directory", os.path.dirname(ckpt_dir)),
        ("the current directory", os.getcwd()),
    ]
    for what, d in protected:
        if _within(d, out):
            raise ExportError(
                f"{flag} {out}: it is or contains {what} ({d}); the export replaces its "
                "directory as a whole: choose another one"
            )
    if _within(out, ckpt_dir):
        raise ExportError(
            f"{flag} {out}: it is inside the checkpoints being exported ({ckpt_dir}): "
            "choose a directory outside it"
        )
    if not os.path.lexists(out):
        _check_writable(out, flag)
        return
    if not os.path.isdir(out):
        raise ExportError(f"{flag} {out}: exists and is not a directory")
    try:
        entries = sorted(os.listdir(out))
    except OSError as e:
        raise ExportError(f"{flag} {out}: cannot be listed ({e.strerror})") from None
    shown = ", ".join(entries[:5]) + (
        f", ... ({len(entries) - 5} more)" if len(entries) > 5 else ""
    )
    if entries and not force:
        raise ExportError(
            f"{flag} {out}: exists and is not empty ({shown}); pass --force to replace a "
            "previous export"
        )
    if entries and EXPORT_MARKER not in entries:
        raise ExportError(
            f"{flag} {out}: holds {shown} but no {EXPORT_MARKER} (it was not made by dtarl "
            "export); --force replaces only a previous export: choose another directory"
        )


def export_checkpoint(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike | None,
    *,
    step: int | None = None,
    force: bool = False,
    dtype: str | None = None,
    adapter: str | os.PathLike | None = None,
) -> tuple[str, int]:
    """Writes step ``step`` (default: the latest) of ``checkpoint`` to ``out`` as a HF
    checkpoint (merged weights for a LoRA run) and, with ``adapter``, a LoRA run's
    adapters as a PEFT adapter directory; returns (out or adapter, step). Raises
    ``ExportError`` naming what is wrong."""
    if out is None and adapter is None:
        raise ExportError("nothing to write: give --hf OUT, --adapter DIR or both")
    mgr, named = locate(checkpoint)
    steps = mgr.steps()
    if step is not None and named is not None and step != named:
        raise ExportError(
            f"{checkpoint} is the directory of step {named} but --step {step} was given; "
            "drop --step or pass the run's out_dir"
        )
    if step is None:
        step = named if named is not None else steps[-1]
    if step not in steps:
        raise ExportError(f"step {step} not found in {mgr.directory}; available steps: {steps}")
    why = integrity.verify(mgr.path(step))
    if why is not None:
        raise ExportError(
            f"{mgr.path(step)}: corrupt checkpoint, not exported: {why}; export an intact "
            f"step with --step (saved: {steps})"
        )
    out = None if out is None else os.fspath(out)
    if out is not None:
        _check_out(out, mgr.directory, force)
    if adapter is not None:
        adapter = os.fspath(adapter)
        _check_out(adapter, mgr.directory, force, "--adapter")
    if dtype is not None and dtype not in SAVE_DTYPES:
        raise ExportError(f"--dtype {dtype}: accepted: {list(SAVE_DTYPES)}")

    try:
        meta = mgr.read_meta(step)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    if not isinstance(meta.get("config"), dict):
        raise ExportError(
            f"{mgr.path(step)}: the checkpoint's metadata has no run config to rebuild the "
            "model from (it was not written by dtarl train)"
        )
    where = f"{mgr.path(step)}: the run's config"
    try:
        cfg = from_dict(TrainerConfig, meta["config"])
    except ValueError as e:
        raise ExportError(f"{where} does not load ({e})") from None
    # The run's own state structure (as a resume builds it); nothing is written into
    # its out_dir, no export is chained, nothing is printed.
    cfg = dataclasses.replace(
        cfg,
        out_dir=os.path.dirname(mgr.directory),
        export=ExportSection(),
        console=False,
        logging=LoggingSection(),
    )
    try:
        trainer = Trainer(cfg)
    except ValueError as e:
        raise ExportError(f"{where} cannot rebuild the model ({e})") from None
    try:
        host = HostRecord.from_dict(mgr.read_host(step), where=mgr.path(step))
        state, _ = mgr.restore_state(step, trainer.restore_target(step, host))
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    params = state.params
    bad = integrity.nonfinite_leaf(leaf_names(params), jax.tree.leaves(params))
    if bad is not None:
        raise ExportError(f"{mgr.path(step)}: parameter {bad!r} holds NaN or inf; not exported")
    if trainer.lora is None and adapter is not None:
        raise ExportError(
            f"--adapter {adapter}: step {step} of {mgr.directory} is a full fine-tuning run "
            "(no model.lora): it has no adapters; export it with --hf"
        )
    if trainer.lora is not None:
        try:
            trainer.lora.check(host.lora_base, where=mgr.path(step))
        except CheckpointError as e:
            raise ExportError(str(e)) from None
        if adapter is not None:
            try:
                save_peft(params, trainer.lora.cfg, adapter, base_model=cfg.model.hf_path)
                with open(os.path.join(adapter, EXPORT_MARKER), "w") as f:
                    f.write(f"dtarl export --adapter of step {step} of {mgr.directory}\n")
            except OSError as e:
                raise ExportError(f"--adapter {adapter}: cannot be written ({e})") from None
        params = trainer.lora.merged(params)
    if out is None:
        return adapter, step
    model = nnx.merge(trainer.graphdef, params)
    tok_dir = cfg.model.tokenizer_path or cfg.model.hf_path
    try:
        save_hf(model, out, dtype=dtype, extra_files=tokenizer_files(tok_dir))
        with open(os.path.join(out, EXPORT_MARKER), "w") as f:
            f.write(f"dtarl export of step {step} of {mgr.directory}\n")
    except OSError as e:
        raise ExportError(f"--hf {out}: cannot be written ({e.strerror or e})") from None
    return out, step


def _export(args: argparse.Namespace) -> int:
    _, step = export_checkpoint(
        args.checkpoint,
        args.hf,
        step=args.step,
        force=args.force,
        dtype=args.dtype,
        adapter=args.adapter,
    )
    for out in (args.hf, args.adapter):
        if out is not None:
            print(
                f"dtarl export: step {step} of {args.checkpoint} -> {out}: "
                f"{sorted(os.listdir(out))}"
            )
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Adds ``export`` to the ``dtarl`` command's subparsers (handler in ``func``)."""
    p = subparsers.add_parser(
        "export",
        help="write a saved training step as a Hugging Face checkpoint",
        description="Write a saved training step (default: the latest) as a Hugging Face "
        "checkpoint: config.json + safetensors (+ the run's tokenizer files).",
    )
    p.add_argument("checkpoint", help="a run's out_dir, its checkpoints/ dir, or a step dir")
    p.add_argument(
        "--hf", default=None, metavar="OUT", help="output directory (LoRA: merged weights)"
    )
    p.add_argument(
        "--adapter",
        default=None,
        metavar="DIR",
        help="a model.lora run: also write its adapters as a PEFT adapter directory",
    )
    p.add_argument("--step", type=int, default=None, help="the step to export (latest)")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    p.add_argument(
        "--dtype",
        choices=list(SAVE_DTYPES),
        default=None,
        help="weights dtype (default: the model's param_dtype)",
    )
    p.set_defaults(func=_export)
    return p


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtarl.commands.export")
    sub = p.add_subparsers(dest="command")
    register(sub)
    args = p.parse_args(["export", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except ValueError as e:
        print(f"dtarl export: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
