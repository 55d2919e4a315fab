"""The `visionrl` command line. Thin: parse arguments, then import the heavy parts (torch, vLLM, Ray).

Exit codes: 0 success, 1 runtime failure, 2 bad input (job file, arguments, data) with a message that says
what is wrong and what to do, never a traceback; 128 + the signal number (143 SIGTERM, 130 SIGINT) when a stop
signal ended `train` after checkpointing the last completed step.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from visionrl.cli_args import (
    deploy_args,
    eval_args,
    export_args,
    fetch_args,
    init_tiny_model_args,
    make_data_args,
    serve_args,
    train_args,
    tune_lora_kernels_args,
    validate_args,
)

if TYPE_CHECKING:
    from visionrl.data.images import ImageBudget

EXIT_BAD_INPUT = 2


def _cmd_validate(args: argparse.Namespace) -> int:
    from visionrl.config import JobConfig, dump_config, load_config

    if args.schema:
        import json

        print(json.dumps(JobConfig.model_json_schema(), indent=2))
        return 0
    if not args.config:
        raise _usage("validate needs a CONFIG path (or --schema)")
    cfg = load_config(args.config, args.overrides)
    if args.check_data:
        from visionrl.data import load_dataset
        from visionrl.data.layouts import Layout

        layout = Layout.of(cfg.data)  # the keys training reads the records by
        for key, path in (("data.train", cfg.data.train), ("data.eval", cfg.data.eval)):
            if path is not None:
                n = len(load_dataset(path, on_bad_image=cfg.data.on_bad_image, layout=layout))
                print(f"# {key}: {n} records in {path}", file=sys.stderr)
    print(dump_config(cfg), end="")
    print(f"# {args.config}: valid", file=sys.stderr)
    return 0


def _cmd_init_tiny_model(args: argparse.Namespace) -> int:
    from visionrl.models.tiny import build_tiny_model

    out = build_tiny_model(
        args.dir, seed=args.seed, pretrain=not args.no_pretrain, arch=args.arch, recipe=args.recipe
    )
    if args.score_head:
        from visionrl.models.score_head import add_score_head

        add_score_head(out)
    head = " with a score head (a classifier judge)" if args.score_head else ""
    print(f"tiny {args.arch} model{head} written to {out}")
    return 0


def _cmd_make_data(args: argparse.Namespace) -> int:
    if args.task == "easy-vqa":
        from visionrl.data.easy_vqa import write_easy_vqa

        summary = write_easy_vqa(args.dir, args.num_train, args.num_eval, args.seed, args.question_type)
    elif args.task == "zoom":  # pictures of their own size, a question per record
        from visionrl.data.zoom import make_zoom_dataset

        train = 512 if args.num_train is None else args.num_train
        summary = make_zoom_dataset(
            args.dir, train, 128 if args.num_eval is None else args.num_eval, args.seed
        )
    else:
        from visionrl.data.synthetic import make_dataset

        summary = make_dataset(
            args.dir,
            args.task,
            512 if args.num_train is None else args.num_train,
            128 if args.num_eval is None else args.num_eval,
            args.seed,
            image_size=args.image_size,
        )
    for split in ("train", "eval"):
        info = summary[split]
        print(f"{split}: {info['num_samples']} records -> {info['file']}  answers: {info['answer_counts']}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from visionrl.config import load_config

    cfg = load_config(args.config, args.overrides)
    if args.verbose:
        from visionrl.orchestrate.console import VERBOSE_ENV

        os.environ[VERBOSE_ENV] = "1"
    from visionrl.orchestrate.loop import train

    result = train(cfg, resume=args.resume)  # None: the job file's `resume`
    print(f"adapter: {result.adapter_dir}")
    return 0


def _eval_budget(args: argparse.Namespace) -> ImageBudget | None:
    """The image budget the eval flags give (None when none is given: the command's own default)."""
    from visionrl.data.images import ImageBudget

    given = {
        "min_pixels": args.min_pixels,
        "max_pixels": args.max_pixels,
        "max_images": args.max_images_per_prompt,
    }
    if all(v is None for v in given.values()):
        return None
    try:
        return ImageBudget(**{k: v for k, v in given.items() if v is not None})
    except ValueError as err:
        raise _usage(f"--min-pixels / --max-pixels / --max-images-per-prompt: {err}") from None


def _cmd_eval(args: argparse.Namespace) -> int:
    from visionrl.data.layouts import Layout
    from visionrl.eval.judged import parse_judges

    common: dict[str, Any] = {
        "data": args.data,
        "out": args.out,
        "ablate_images": args.ablate_images,
        "max_samples": args.max_samples,
        "max_tokens": args.max_tokens,
        "rewards": args.reward,
        "seed": args.seed,
        "budget": _eval_budget(args),
        "layout": Layout(prompt_key=args.prompt_key, answer_key=args.answer_key, image_key=args.image_key),
        "judges": parse_judges(args.judge) if args.judge else None,
    }
    served = args.endpoint or args.sagemaker_endpoint
    if args.env:
        common["env"] = _job_env(args.env)
    if args.endpoint and args.sagemaker_endpoint:
        raise _usage("--endpoint and --sagemaker-endpoint name two servers: give one")
    if served:
        from visionrl.eval.endpoint import check_failures, evaluate_endpoint

        report = evaluate_endpoint(
            endpoint=args.endpoint,
            model=args.model,
            concurrency=args.concurrency,
            timeout_s=args.timeout,
            base=args.base,
            api_key=args.api_key,
            sagemaker_endpoint=args.sagemaker_endpoint,
            region=args.region,
            **common,
        )
        _print_report(report, args.out)
        check_failures(report, args.max_failed_fraction, args.out)
        return _judges_ok(report, args.out)
    if not args.base:
        raise _usage("eval needs --base MODEL (local evaluation) or --endpoint URL (a served model)")
    from visionrl.eval.local import evaluate_local

    report = evaluate_local(base=args.base, adapter=args.adapter, engine=args.engine, **common)
    _print_report(report, args.out)
    return _judges_ok(report, args.out)


def _job_env(path: str) -> Any:
    """The `env` section of the job file `path` (a usage error when it has none)."""
    from visionrl.config import load_config

    env = load_config(path).env
    if env is None:
        raise _usage(f"--env {path}: the job file has no env section")
    return env


def _print_report(report: dict[str, Any], out: str) -> None:
    print(
        f"accuracy {report['accuracy']:.3f} on {report['num_samples']} samples "
        f"({report['num_failed']} failed) -> {out}"
    )
    for key, j in (report.get("judges") or {}).items():
        mean = "-" if j["mean"] is None else f"{j['mean']:.3f}"
        accepted = "-" if j["accepted"] is None else f"{j['accepted']:.3f}"
        failed = j["errors"] + j["timeouts"]
        print(
            f"judge {key} ({j['backend']}): mean {mean}, accepted {accepted} of {j['num_judged']} ({failed} failed)"
        )


def _judges_ok(report: dict[str, Any], out: str) -> int:
    """1 (the report is written) when a judge failed on every answered sample: its first error says why."""
    from visionrl.eval.judged import failed_judges

    failed = failed_judges(report)
    for line in failed:
        print(f"error: judge {line}", file=sys.stderr)
    if failed:
        print(
            f"the judge scores in {out} are missing; check the judge's model, endpoint and template",
            file=sys.stderr,
        )
    return 1 if failed else 0


def _cmd_export(args: argparse.Namespace) -> int:
    from visionrl.adapter.export import export_adapter

    manifest = export_adapter(
        args.src, args.dest, allow_unservable=args.allow_unservable, overwrite=args.overwrite
    )
    # the manifest lists the adapter's files; it is written beside them
    print(f"exported {len(manifest['files'])} adapter files and their manifest to {args.dest}")
    return 0


def _cmd_fetch(args: argparse.Namespace) -> int:
    from visionrl.adapter.fetch import fetch_adapter

    print(fetch_adapter(args.src, args.cache_dir).resolve())
    return 0


def _cmd_tune_lora_kernels(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from visionrl.config import load_config
    from visionrl.errors import InputError, RunError

    cfg = load_config(args.config, args.overrides)
    config_file = Path(cfg.model.path) / "config.json"
    if not config_file.is_file():
        raise InputError(
            f"model.path {cfg.model.path}: no config.json there; the tuner reads the model's layer sizes from it "
            "(set model.path to the checkpoint folder the job trains)"
        )
    import torch

    if not torch.cuda.is_available():
        raise RunError(
            "tune-lora-kernels times vLLM's LoRA kernels on a CUDA GPU and sees none here: run it once on a machine "
            "with the GPU model the job trains on (vLLM reads the files by GPU model)"
        )
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise RunError(
            "tune-lora-kernels times vLLM's own LoRA kernels and vLLM is not installed here: "
            "pip install 'visionrl[gpu]' (the vLLM release the job's engines run)"
        )
    from visionrl.rollout.lora_kernels import KernelTimer, language_model_config, report_table, tune_model

    timer, out = KernelTimer(), Path(args.out)
    text = language_model_config(Path(cfg.model.path))
    report = tune_model(text, cfg.lora.rank, out, timer, timer.device_name, budget_s=args.budget_s)
    (out / "tune_report.json").write_text(json.dumps(report, indent=1) + "\n")
    decode = cfg.rollout.prompts_per_step * cfg.algorithm.group_size
    print(report_table(report, max((m for m in report["per_decode_step_us"] if int(m) <= decode), key=int)))
    print(f"\nvLLM's LoRA kernel configs for the {timer.device_name} in {out}; the job uses them with")
    print(f"  rollout:\n    vllm_env: {{VLLM_TUNED_CONFIG_FOLDER: {out.resolve()}}}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from visionrl.serve import sagemaker

    if args.sagemaker or (not args.base and sagemaker.in_sagemaker(os.environ)):
        if args.api_key:
            raise _usage("--api-key: SageMaker's runtime signs requests with IAM and sends no key; drop it")
        return sagemaker.serve_sagemaker(
            args.base, args.adapter, host=args.host or "0.0.0.0", port=args.port, extra=args.vllm_arg
        )
    if not args.base:
        raise _usage("serve needs --base MODEL (or --sagemaker for SageMaker's hosting contract)")
    from visionrl.serve.server import serve

    return serve(
        base=args.base,
        adapters=args.adapter,
        host=args.host or "127.0.0.1",
        port=8000 if args.port is None else args.port,
        extra=args.vllm_arg,
        api_key=args.api_key,
        allow_insecure=args.allow_insecure,
    )


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    """{key: value} of `KEY=VALUE` items; a usage error names the bad one."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise _usage(f"{flag} {item!r} is not KEY=VALUE")
        out[key] = value
    return out


def _cmd_deploy(args: argparse.Namespace) -> int:
    from visionrl.deploy import sagemaker

    if args.delete:
        sagemaker.delete(args.name, client=sagemaker.sagemaker_client(args.region))
        return 0
    missing = [flag for flag, value in (("--role", args.role), ("--base", args.base)) if not value]
    if missing:
        raise _usage(f"deploy sagemaker needs {' and '.join(missing)} (or --delete)")
    adapters = _pairs(args.adapter, "--adapter")
    spec = sagemaker.EndpointSpec(
        name=args.name, image=args.image or os.environ.get("VISIONRL_IMAGE", ""), role=args.role, base=args.base,
        adapters=adapters, instance_type=args.instance_type, instance_count=args.instance_count,
        environment=_pairs(args.env, "--env"), startup_timeout_s=args.startup_timeout, adapter_root=args.adapter_root,
    )  # fmt: skip
    sagemaker.deploy(spec, region=args.region, wait=not args.no_wait)
    print(sagemaker.invoke_hint(args.name, list(adapters)))
    return 0


class _UsageError(Exception):
    pass


def _usage(msg: str) -> _UsageError:
    return _UsageError(msg)


Handler = Callable[[argparse.Namespace], int]

#: The subcommands in the order `visionrl --help` lists them: name, handler, help line, its arguments.
COMMANDS: tuple[tuple[str, Handler, str, Callable[[argparse.ArgumentParser], None]], ...] = (
    ("train", _cmd_train, "Train a LoRA adapter by GRPO from a YAML job file.", train_args),
    ("validate", _cmd_validate, "Check a job file and print the resolved config.", validate_args),
    (
        "eval",
        _cmd_eval,
        "Measure accuracy (and latency) of a base model + adapter, locally or at an endpoint.",
        eval_args,
    ),
    (
        "export",
        _cmd_export,
        "Export a trained adapter with its manifest to a folder or s3://bucket/prefix.",
        export_args,
    ),
    (
        "fetch",
        _cmd_fetch,
        "Download an exported adapter, verify it against its manifest, print its path.",
        fetch_args,
    ),
    (
        "serve",
        _cmd_serve,
        "Serve a base model with LoRA adapters through vLLM's OpenAI-compatible server.",
        serve_args,
    ),
    (
        "deploy",
        _cmd_deploy,
        "Deploy a base model with exported adapters to a SageMaker endpoint (or delete one).",
        deploy_args,
    ),
    (
        "init-tiny-model",
        _cmd_init_tiny_model,
        "Write a tiny Qwen3-VL (or Qwen2.5-VL) checkpoint (for tests and the demo).",
        init_tiny_model_args,
    ),
    ("make-data", _cmd_make_data, "Write a visual task as JSONL + PNG images.", make_data_args),
    (
        "tune-lora-kernels",
        _cmd_tune_lora_kernels,
        "Tune vLLM's LoRA kernels for a job's model and rank on this GPU (a folder the job's engines read).",
        tune_lora_kernels_args,
    ),
)


class _WithDefaults(argparse.HelpFormatter):
    """`--help` shows an option's default where it has one (not None, False or already in its text)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = "default" in text.lower() or action.default in (None, False, argparse.SUPPRESS, [], "")
        return text if shown or not action.option_strings else f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="visionrl",
        description="RL post-training (GRPO) of vision-language models with LoRA, vLLM rollouts and Ray.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, handler, help_, add_arguments in COMMANDS:
        sp = sub.add_parser(name, help=help_, description=help_, formatter_class=_WithDefaults)
        sp.set_defaults(func=handler)
        add_arguments(sp)
    return p


def _log_to_console() -> None:
    """visionrl's own INFO lines (placement, resume, skipped records) on stderr, once."""
    import logging

    log = logging.getLogger("visionrl")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[visionrl] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _log_to_console()
    from visionrl.errors import BAD_INPUT_ERRORS, Preempted, RunError

    try:
        return int(args.func(args) or 0)
    except _UsageError as err:
        parser.error(str(err))  # exits 2
    except BAD_INPUT_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Preempted as err:  # SIGTERM/SIGINT: the last completed step is checkpointed
        print(f"error: {err}", file=sys.stderr)
        return err.exit_status
    except RunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
