"""`visionrl deploy sagemaker`: a SageMaker real-time endpoint for a base model and exported adapters, through
boto3 (docs/AWS.md walks the whole path).

What it creates, each named `<endpoint>-<UTC time>` and tagged `visionrl-endpoint=<endpoint>`: a model (the image,
the execution role, the base model as uncompressed model data SageMaker copies to /opt/ml/model, the adapters in
VISIONRL_ADAPTERS, which the container fetches and checks at start), an endpoint config (one variant: instance type
and count, the time allowed to copy the model and to answer /ping), and the endpoint. An endpoint that exists
is moved to the new config (SageMaker replaces its instances without downtime) and the config and model it had are
deleted once it is in service. `--delete` removes the endpoint, its config and its model. Every adapter is checked
against its manifest before anything is created, so a damaged export fails here, not in the container.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from visionrl.adapter.manifest import verify_adapter
from visionrl.errors import InputError, RunError
from visionrl.serve.sagemaker import ADAPTER_ROOT_ENV, ADAPTERS_ENV, BASE_ENV
from visionrl.serve.sagemaker_backend import BASE_NAME

TAG = "visionrl-endpoint"
VARIANT = "main"
POLL_S = 30.0
WAIT_S = 3600.0  # an 8B model: copy, image pull and load take 10-20 minutes
MAX_NAME = 63  # SageMaker's limit on model, config and endpoint names


@dataclass(frozen=True)
class EndpointSpec:
    """What `deploy sagemaker` is asked for."""

    name: str
    image: str
    role: str
    base: str  # s3://bucket/prefix/ of a checkpoint folder, or a path inside the image
    adapters: Mapping[str, str] = field(default_factory=dict)  # name -> s3:// export
    instance_type: str = "ml.g6e.2xlarge"
    instance_count: int = 1
    environment: Mapping[str, str] = field(default_factory=dict)
    startup_timeout_s: int = 1800  # SageMaker's limit for the model copy and for /ping's first 200, each
    adapter_root: str | None = None  # s3:// prefix whose exports load on their first request

    def check(self) -> None:
        problems = []
        if not self.name or len(self.name) > MAX_NAME - 20 or not self.name.replace("-", "").isalnum():
            problems.append(
                f"--name {self.name!r}: letters, digits and '-', at most {MAX_NAME - 20} characters"
            )
        if not self.image:
            problems.append(
                "--image: the image URI in ECR (deploy/push_image.sh prints it; or set VISIONRL_IMAGE)"
            )
        if not self.role.startswith("arn:"):
            problems.append(
                f"--role {self.role!r}: the ARN of an IAM role SageMaker can assume (docs/AWS.md)"
            )
        if self.instance_count < 1:
            problems.append(f"--instance-count {self.instance_count}: at least 1")
        for name, src in self.adapters.items():
            if not src.startswith("s3://"):
                problems.append(f"adapter {name}={src}: the container fetches adapters from s3:// only")
        if self.adapter_root is not None and not self.adapter_root.startswith("s3://"):
            problems.append(f"--adapter-root {self.adapter_root}: an s3:// prefix")
        if problems:
            raise InputError("deploy sagemaker:\n  - " + "\n  - ".join(problems))

    def container(self) -> dict[str, Any]:
        """The model's PrimaryContainer: SageMaker copies an s3:// base to /opt/ml/model itself."""
        env = dict(self.environment)
        if self.adapters:
            env[ADAPTERS_ENV] = ",".join(f"{n}={s}" for n, s in self.adapters.items())
        if self.adapter_root:
            env[ADAPTER_ROOT_ENV] = self.adapter_root
        container: dict[str, Any] = {"Image": self.image, "Environment": env}
        if self.base.startswith("s3://"):
            uri = self.base.rstrip("/") + "/"  # an S3 prefix ends with a slash
            source = {"S3Uri": uri, "S3DataType": "S3Prefix", "CompressionType": "None"}
            container["ModelDataSource"] = {"S3DataSource": source}
        else:
            env[BASE_ENV] = self.base
        return container


@contextmanager
def aws_errors(doing: str) -> Iterator[None]:
    """botocore's errors as one line saying what SageMaker refused and what to check (no traceback)."""
    import botocore.exceptions as bx  # type: ignore[import-untyped]

    try:
        yield
    except (bx.NoCredentialsError, bx.PartialCredentialsError, bx.NoRegionError) as err:
        raise InputError(f"{doing}: {err}. Set AWS credentials (a profile, a role, or the AWS_* variables) and "
                         "AWS_REGION or --region") from None  # fmt: skip
    except bx.ClientError as err:
        code = err.response.get("Error", {}).get("Code", "")
        hint = " Check the permissions of your identity (docs/AWS.md, IAM)" if "Denied" in code else ""
        raise RunError(f"{doing}: SageMaker refused ({code}): {err}.{hint}") from None
    except bx.EndpointConnectionError as err:
        raise RunError(
            f"{doing}: SageMaker did not answer ({err}); check the region and the network"
        ) from None


def _tags(spec: EndpointSpec) -> list[dict[str, str]]:
    return [{"Key": TAG, "Value": spec.name}]


def _exists(client: Any, name: str) -> dict[str, Any] | None:
    """describe_endpoint, or None when there is no such endpoint."""
    import botocore.exceptions as bx

    try:
        return dict(client.describe_endpoint(EndpointName=name))
    except bx.ClientError as err:
        if "Could not find endpoint" in str(err):
            return None
        raise


def _old_parts(client: Any, endpoint: Mapping[str, Any]) -> tuple[str, list[str]]:
    """(endpoint config, its models) of an existing endpoint."""
    config = str(endpoint["EndpointConfigName"])
    variants = client.describe_endpoint_config(EndpointConfigName=config)["ProductionVariants"]
    return config, [str(v["ModelName"]) for v in variants]


def deploy(spec: EndpointSpec, *, client: Any = None, region: str | None = None, wait: bool = True,
           poll_s: float = POLL_S, wait_s: float = WAIT_S, say: Callable[[str], None] = print,
           stamp: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Create or update the endpoint of `spec`; with `wait`, return once it is in service (RunError with
    SageMaker's reason if it fails). Returns the final describe_endpoint. The spec and the adapters are checked
    before a client (`client`, else one for `region`) is made."""
    spec.check()
    for name, src in spec.adapters.items():
        verify_adapter(src)  # ExportError names the bad file
        say(f"adapter {name}: {src} matches its manifest")
    with aws_errors(f"deploying endpoint {spec.name}"):
        return _deploy(spec, client or sagemaker_client(region), wait, poll_s, wait_s, say, stamp)


def _deploy(spec: EndpointSpec, client: Any, wait: bool, poll_s: float, wait_s: float, say: Callable[[str], None],
            stamp: str | None) -> dict[str, Any]:  # fmt: skip
    stamp = stamp or _stamp()
    part = f"{spec.name}-{stamp}"
    existing = _exists(client, spec.name)
    client.create_model(ModelName=part, ExecutionRoleArn=spec.role, PrimaryContainer=spec.container(),
                        Tags=_tags(spec))  # fmt: skip
    variant = {"VariantName": VARIANT, "ModelName": part, "InstanceType": spec.instance_type,
               "InitialInstanceCount": spec.instance_count,
               "ModelDataDownloadTimeoutInSeconds": spec.startup_timeout_s,
               "ContainerStartupHealthCheckTimeoutInSeconds": spec.startup_timeout_s}  # fmt: skip
    client.create_endpoint_config(EndpointConfigName=part, ProductionVariants=[variant], Tags=_tags(spec))
    if existing is None:
        client.create_endpoint(EndpointName=spec.name, EndpointConfigName=part, Tags=_tags(spec))
        say(f"creating endpoint {spec.name} (model and config {part})")
    else:
        client.update_endpoint(EndpointName=spec.name, EndpointConfigName=part)
        say(f"updating endpoint {spec.name} to config {part} (it was on {existing['EndpointConfigName']})")
    if not wait:
        return dict(client.describe_endpoint(EndpointName=spec.name))
    final = wait_in_service(client, spec.name, poll_s=poll_s, wait_s=wait_s, say=say)
    if existing is not None:
        config, models = _old_parts(client, existing)
        _delete_parts(client, config, models, say)
    return final


def wait_in_service(client: Any, name: str, *, poll_s: float, wait_s: float, say: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """Poll until the endpoint is InService; RunError when it fails or takes longer than `wait_s`."""
    start, last = time.monotonic(), ""
    while True:
        endpoint = dict(client.describe_endpoint(EndpointName=name))
        status = str(endpoint["EndpointStatus"])
        if status == "InService":
            say(f"endpoint {name} is in service after {time.monotonic() - start:.0f} s")
            return endpoint
        if status == "Failed":
            raise RunError(
                f"endpoint {name} failed: {endpoint.get('FailureReason', 'no reason given')}. The container's log "
                f"is in CloudWatch, log group /aws/sagemaker/Endpoints/{name}; delete it with "
                f"`visionrl deploy sagemaker --name {name} --delete`"
            )
        if status != last:
            say(f"endpoint {name}: {status} ({time.monotonic() - start:.0f} s)")
            last = status
        if time.monotonic() - start > wait_s:
            raise RunError(f"endpoint {name} is still {status} after {wait_s:.0f} s; see its CloudWatch log")
        time.sleep(poll_s)


def _delete_parts(client: Any, config: str, models: Sequence[str], say: Callable[[str], None]) -> None:
    client.delete_endpoint_config(EndpointConfigName=config)
    for model in models:
        client.delete_model(ModelName=model)
    say(f"deleted endpoint config {config} and model {', '.join(models)}")


def delete(name: str, *, client: Any = None, say: Callable[[str], None] = print) -> None:
    """Delete the endpoint `name`, its endpoint config and its models."""
    client = client or sagemaker_client()
    with aws_errors(f"deleting endpoint {name}"):
        _delete(client, name, say)


def _delete(client: Any, name: str, say: Callable[[str], None]) -> None:
    endpoint = _exists(client, name)
    if endpoint is None:
        raise InputError(f"there is no endpoint {name!r} in this account and region; nothing to delete")
    config, models = _old_parts(client, endpoint)
    client.delete_endpoint(EndpointName=name)
    say(f"deleted endpoint {name}")
    _delete_parts(client, config, models, say)


def invoke_hint(name: str, adapters: Sequence[str]) -> str:
    """How to call the endpoint, for the console."""
    model = adapters[0] if adapters else BASE_NAME
    return (
        f"evaluate: visionrl eval --sagemaker-endpoint {name} --model {model} --data EVAL.jsonl --out report.json\n"
        "invoke:   aws sagemaker-runtime invoke-endpoint --endpoint-name "
        f"{name} --content-type application/json --body fileb://request.json answer.json\n"
        f'          (request.json: {{"model": "{model}", "messages": [...], "max_tokens": 64}}, an OpenAI chat request)'
    )


def _stamp() -> str:
    """UTC time to the millisecond: the new model's and config's names differ from the last deploy's."""
    now = time.time()
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + f"-{int(now * 1000) % 1000:03d}"


def sagemaker_client(region: str | None = None) -> Any:
    """boto3's SageMaker client for `region` (default: the AWS environment's); a missing region is an InputError."""
    import boto3  # type: ignore[import-untyped]

    with aws_errors("connecting to SageMaker"):
        return boto3.client("sagemaker", region_name=region)
