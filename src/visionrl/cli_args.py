"""The arguments of each `visionrl` subcommand (its --help), apart from what the commands do (`visionrl.cli`)."""

from __future__ import annotations

import argparse


def resume_mode(value: str) -> str:
    if value != "auto":
        raise argparse.ArgumentTypeError(f"expected `--resume` alone or `--resume auto`, got {value!r}")
    return value


def train_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("config", help="job file (YAML), e.g. configs/demo.yaml")
    sp.add_argument(
        "overrides", nargs="*", help="key=value overrides, e.g. train.steps=10 rollout.temperature=0.8"
    )
    sp.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        type=resume_mode,
        metavar="auto",
        help="continue from the newest complete checkpoint in output_dir; `--resume auto` starts fresh when there "
        "is none (for jobs a scheduler re-runs). Default: the job file's `resume`",
    )
    sp.add_argument(
        "--verbose",
        action="store_true",
        help="show the libraries' output (vLLM, Ray, transformers, torch) on the console; by default it goes to "
        "<output_dir>/libraries.log",
    )


def validate_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("config", nargs="?", help="job file (YAML)")
    sp.add_argument("overrides", nargs="*", help="key=value overrides")
    sp.add_argument("--schema", action="store_true", help="print the JSON schema of job files")
    sp.add_argument(
        "--check-data",
        action="store_true",
        help="also load data.train and data.eval (every record and image checked, as training does)",
    )


def eval_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--data", required=True, help="evaluation data (JSONL or Parquet)")
    sp.add_argument(
        "--out", required=True, help="where to write the JSON report (a Markdown twin is written too)"
    )
    sp.add_argument(
        "--base",
        help="local evaluation: base model directory (with --endpoint: optional, "
        "forbids its vision tokens as local evaluation does)",
    )
    sp.add_argument("--adapter", help="local evaluation: adapter directory (omit for the base model)")
    sp.add_argument("--engine", choices=["vllm", "hf"], default="vllm", help="local evaluation engine")
    sp.add_argument(
        "--env",
        metavar="JOB",
        help="local evaluation of multi-turn episodes: a job file whose `env` section plays each question as one "
        "greedy episode (its final turn is the answer)",
    )
    served_eval_args(sp)
    sp.add_argument(
        "--ablate-images", action="store_true", help="permute images across samples (does it look?)"
    )
    sp.add_argument("--max-samples", type=int, default=None, help="evaluate at most this many records")
    sp.add_argument("--max-tokens", type=int, default=32, help="maximum new tokens per answer")
    sp.add_argument(
        "--reward",
        action="append",
        default=None,
        help="scoring reward (default exact_match; repeatable, e.g. numeric)",
    )
    sp.add_argument("--seed", type=int, default=0, help="seed (image permutation)")
    sp.add_argument(
        "--judge",
        metavar="SPEC",
        help="also score the answers with a judge: a job file (its judge rewards), a YAML file of a judge entry, "
        "or an inline mapping, e.g. '{backend: endpoint, base_url: URL, model: NAME, template: FILE}' (README, Rewards)",
    )
    sp.add_argument(
        "--min-pixels",
        type=int,
        help="image budget (data.min_pixels); default: the adapter's manifest (local), else 1024",
    )
    sp.add_argument(
        "--max-pixels",
        type=int,
        help="image budget (data.max_pixels); default: the adapter's manifest (local), else 1048576; "
        "with --endpoint: the budget the server was started with",
    )
    sp.add_argument(
        "--max-images-per-prompt", type=int, help="image budget (data.max_images_per_prompt), default 4"
    )
    for key, default in (("prompt", "prompt"), ("image", "images"), ("answer", "answer")):
        sp.add_argument(
            f"--{key}-key",
            default=default,
            help=f"field of a record holding its {key} (data.{key}_key of a job)",
        )


def served_eval_args(sp: argparse.ArgumentParser) -> None:
    """The options of `eval --endpoint` alone."""
    sp.add_argument(
        "--endpoint", help="served evaluation: OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1"
    )
    sp.add_argument(
        "--sagemaker-endpoint",
        metavar="NAME",
        help="served evaluation through a SageMaker endpoint's runtime API (`visionrl deploy sagemaker`; AWS "
        "credentials and region from the environment)",
    )
    sp.add_argument("--region", help="AWS region of --sagemaker-endpoint (default: the AWS environment's)")
    sp.add_argument("--model", help="served evaluation: model or adapter name at the endpoint")
    sp.add_argument("--concurrency", type=int, default=8, help="parallel requests (served evaluation)")
    sp.add_argument("--timeout", type=float, default=60.0, help="seconds per request (served evaluation)")
    sp.add_argument(
        "--max-failed-fraction",
        type=float,
        default=0.1,
        help="served evaluation: exit 1 (report still written) when more requests than this share failed",
    )
    sp.add_argument(
        "--api-key", default=None, help="served evaluation: the server's API key (default: $VLLM_API_KEY)"
    )


def export_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("src", help="run directory or checkpoint directory")
    sp.add_argument("dest", help="destination folder or s3://bucket/prefix")
    sp.add_argument(
        "--allow-unservable",
        action="store_true",
        help="export even if vLLM cannot serve the adapter as trained (the problems are listed)",
    )
    sp.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a destination that holds other files (they are left as they are)",
    )


def fetch_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("src", help="exported adapter: folder or s3://bucket/prefix")
    sp.add_argument("--cache-dir", default=None, help="local cache (default ~/.cache/visionrl/adapters)")


def serve_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--base",
        help="base model directory (with --sagemaker also s3://; default there: $VISIONRL_BASE_MODEL, else the "
        "model directory SageMaker mounts, $SM_MODEL_DIR or /opt/ml/model)",
    )
    sp.add_argument(
        "--sagemaker",
        action="store_true",
        help="SageMaker's hosting contract (docs/AWS.md): port 8080 on 0.0.0.0, /ping 503 until loaded, "
        "/invocations, /adapters; adapters also from $VISIONRL_ADAPTERS. The default without --base where "
        "SageMaker's model directory exists (`docker run IMAGE serve`)",
    )
    sp.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=SRC",
        help="exported adapter (folder or s3://) served as NAME (repeatable)",
    )
    sp.add_argument(
        "--host",
        default=None,
        help="address to bind (default 127.0.0.1; with --sagemaker 0.0.0.0); a non-loopback one needs an API key, "
        "except under --sagemaker, where SageMaker's runtime is the only caller",
    )
    sp.add_argument(
        "--port",
        type=int,
        default=None,
        help="default 8000; with --sagemaker $SAGEMAKER_BIND_TO_PORT or 8080",
    )
    sp.add_argument(
        "--api-key",
        default=None,
        help="require this bearer token on every /v1 endpoint, adapter load/unload included (default: "
        "$VLLM_API_KEY; the environment variable keeps it out of the process list)",
    )
    sp.add_argument(
        "--allow-insecure",
        action="store_true",
        help="serve on a non-loopback --host without an API key (only on a closed network)",
    )
    sp.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        help="extra argument passed to vLLM, last (repeatable; flags as --vllm-arg=--max-num-seqs=8)",
    )


def deploy_args(sp: argparse.ArgumentParser) -> None:
    targets = sp.add_subparsers(dest="target", required=True, metavar="TARGET")
    sm = targets.add_parser(
        "sagemaker",
        help="a SageMaker real-time endpoint (docs/AWS.md)",
        description="Create or update a SageMaker endpoint serving a base model with exported adapters (the image "
        "runs `visionrl serve --sagemaker`), wait until it is in service and print how to call it; or --delete it.",
    )
    sm.add_argument("--name", required=True, help="endpoint name")
    sm.add_argument("--delete", action="store_true", help="delete the endpoint, its config and its model")
    sm.add_argument("--image", default=None, help="image URI in ECR (default: $VISIONRL_IMAGE)")
    sm.add_argument("--role", default=None, help="ARN of the execution role SageMaker assumes (docs/AWS.md)")
    sm.add_argument(
        "--base",
        default=None,
        help="base model: s3://bucket/prefix/ of a checkpoint folder (SageMaker copies it to /opt/ml/model), "
        "or a path inside the image",
    )
    sm.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=s3://...",
        help="exported adapter served as NAME (repeatable; checked against its manifest first)",
    )
    sm.add_argument(
        "--adapter-root",
        default=None,
        metavar="s3://...",
        help="an S3 prefix of exports: a request for NAME loads ROOT/NAME on its first use (checked against its "
        "manifest), so adapters exported later are served without a new deploy",
    )
    sm.add_argument("--instance-type", default="ml.g6e.2xlarge", help="e.g. ml.g6e.2xlarge (one L40S, 48 GB)")
    sm.add_argument("--instance-count", type=int, default=1)
    sm.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="container environment (repeatable), e.g. VISIONRL_VLLM_ARGS='--max-loras 4'",
    )
    sm.add_argument(
        "--startup-timeout",
        type=int,
        default=1800,
        help="seconds SageMaker allows to copy the model and to load it",
    )
    sm.add_argument("--region", default=None, help="AWS region (default: the AWS environment's)")
    sm.add_argument("--no-wait", action="store_true", help="return once the request is made")


def init_tiny_model_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("dir")
    # The names are the models' `model_type` (models.tiny.ARCHS), listed here so that --help stays instant.
    sp.add_argument(
        "--arch",
        choices=("qwen3_vl", "qwen2_5_vl"),
        default="qwen3_vl",
        help="architecture (default qwen3_vl)",
    )
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--no-pretrain", action="store_true", help="random weights only (no short pre-training)")
    sp.add_argument(
        "--recipe",
        default="color",
        choices=["color", "same_color", "easy-vqa", "judge-color", "zoom"],
        help="the task the pre-trained base is made for: it answers that task in format, at chance "
        "(easy-vqa also adds the data set's words to the tokenizer); judge-color makes a tiny judge instead, "
        "which answers yes or no to configs/judges/color_match.txt (a `judge` reward's model); zoom: a base that "
        "calls the crop tool (on a random quadrant) and reads the colour of what it gets back",
    )
    sp.add_argument(
        "--score-head",
        action="store_true",
        help="also write a sequence-classification score head (lm_head of 'yes' minus 'no'), so the model is a "
        "reward model for a judge with backend classifier",
    )


def tune_lora_kernels_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("config", help="job file (YAML): its model.path and lora.rank give the kernels' shapes")
    sp.add_argument("overrides", nargs="*", help="key=value overrides")
    sp.add_argument(
        "--out",
        default="lora-kernel-configs",
        help="the folder for vLLM's files (on a cluster: a path every node sees, as rollout.vllm_env names it)",
    )
    sp.add_argument(
        "--budget-s",
        type=float,
        default=600.0,
        help="stop searching after this many seconds; shapes not reached keep vLLM's default config",
    )


def make_data_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("dir")
    sp.add_argument(
        "--task",
        required=True,
        help="synthetic: color | count | position | sides | same_color (two images) | zoom (a detail to crop); "
        "easy-vqa: the easy-VQA data set (pip install easy-vqa)",
    )
    sp.add_argument(
        "--num-train", type=int, default=None, help="train records (synthetic default 512; easy-vqa: all)"
    )
    sp.add_argument(
        "--num-eval", type=int, default=None, help="eval records (synthetic default 128; easy-vqa: all)"
    )
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--image-size", type=int, default=64)
    sp.add_argument(
        "--question-type",
        choices=["yes/no", "shape", "color"],
        default=None,
        help="easy-vqa: only the questions of this type (default: all)",
    )
