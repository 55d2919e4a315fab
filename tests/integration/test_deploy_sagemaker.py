"""`visionrl deploy sagemaker` against a local SageMaker and S3 (moto's server on 127.0.0.1, with UpdateEndpoint
added: tests/moto_sagemaker.py): every request it makes is recorded through botocore's events and checked, for a
first deploy, an update to a new adapter set (the old config and model deleted) and --delete. A damaged adapter
export stops the deploy before any SageMaker request."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.aws_local import REGION, moto_server, point_aws_at
from tests.integration.random_adapter import random_adapter

from visionrl.adapter.export import export_adapter
from visionrl.adapter.storage import filesystem
from visionrl.cli import EXIT_BAD_INPUT, main

pytestmark = pytest.mark.slow

BUCKET = "visionrl-deploy"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/visionrl:0.1.0-abc1234"
ROLE = "arn:aws:iam::123456789012:role/visionrl-sagemaker"


@pytest.fixture(scope="module")
def aws(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Path]:
    import boto3

    home = tmp_path_factory.mktemp("aws")
    with moto_server(home, update_endpoint=True) as url, pytest.MonkeyPatch.context() as mp:
        point_aws_at(mp, url, home)
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        for name, seed in (("a1", 1), ("a2", 2), ("bad", 3)):
            export_adapter(random_adapter(tiny_model, home / name, seed=seed), f"s3://{BUCKET}/{name}")
        filesystem(f"s3://{BUCKET}")[0].pipe(f"{BUCKET}/bad/adapter_model.safetensors", b"not the weights")
        yield home


@pytest.fixture
def calls(aws: Path) -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """(operation, parameters) of every SageMaker request boto3's default session makes."""
    import boto3

    seen: list[tuple[str, dict[str, Any]]] = []

    def record(model: Any, params: dict[str, Any], **_: Any) -> None:
        seen.append((model.name, params))

    boto3.setup_default_session()
    assert boto3.DEFAULT_SESSION is not None
    boto3.DEFAULT_SESSION.events.register("provide-client-params.sagemaker", record)
    yield seen
    boto3.DEFAULT_SESSION = None


def _sagemaker() -> Any:
    import boto3

    return boto3.session.Session().client("sagemaker", region_name=REGION)


def _deploy(*adapters: str, root: bool = False) -> int:
    argv = ["deploy", "sagemaker", "--name", "color", "--image", IMAGE, "--role", ROLE, "--base",
            f"s3://{BUCKET}/base", "--env", "VISIONRL_VLLM_ARGS=--max-loras 4", "--instance-type", "ml.g4dn.2xlarge"]  # fmt: skip
    # (moto checks instance types against an older list than SageMaker's: the default ml.g6e.2xlarge is not on it)
    for name in adapters:
        argv += ["--adapter", f"{name}=s3://{BUCKET}/{name}"]
    return main(argv + (["--adapter-root", f"s3://{BUCKET}/later/"] if root else []))


def test_deploy_update_and_delete(
    calls: list[tuple[str, dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _deploy("a1", root=True) == 0
    names = [op for op, _ in calls]
    assert names == [
        "DescribeEndpoint",
        "CreateModel",
        "CreateEndpointConfig",
        "CreateEndpoint",
        "DescribeEndpoint",
    ]
    model = calls[1][1]
    part = model["ModelName"]
    assert part.startswith("color-") and len(part) <= 63
    assert model["ExecutionRoleArn"] == ROLE and model["Tags"] == [
        {"Key": "visionrl-endpoint", "Value": "color"}
    ]
    assert model["PrimaryContainer"] == {
        "Image": IMAGE,
        "Environment": {
            "VISIONRL_VLLM_ARGS": "--max-loras 4",
            "VISIONRL_ADAPTERS": f"a1=s3://{BUCKET}/a1",
            "VISIONRL_ADAPTER_ROOT": f"s3://{BUCKET}/later/",
        },
        "ModelDataSource": {
            "S3DataSource": {
                "S3Uri": f"s3://{BUCKET}/base/",
                "S3DataType": "S3Prefix",
                "CompressionType": "None",
            }
        },
    }
    assert calls[2][1]["EndpointConfigName"] == part and calls[2][1]["ProductionVariants"] == [
        {"VariantName": "main", "ModelName": part, "InstanceType": "ml.g4dn.2xlarge", "InitialInstanceCount": 1,
         "ModelDataDownloadTimeoutInSeconds": 1800, "ContainerStartupHealthCheckTimeoutInSeconds": 1800}
    ]  # fmt: skip
    assert calls[3][1] == {"EndpointName": "color", "EndpointConfigName": part, "Tags": model["Tags"]}
    out = capsys.readouterr().out
    assert "endpoint color is in service" in out
    assert "visionrl eval --sagemaker-endpoint color --model a1" in out

    calls.clear()
    assert _deploy("a1", "a2") == 0  # a new adapter set: a new model and config, the endpoint moved to them
    names = [op for op, _ in calls]
    assert names == ["DescribeEndpoint", "CreateModel", "CreateEndpointConfig", "UpdateEndpoint", "DescribeEndpoint",
                     "DescribeEndpointConfig", "DeleteEndpointConfig", "DeleteModel"]  # fmt: skip
    new = calls[1][1]["ModelName"]
    assert new != part and calls[1][1]["PrimaryContainer"]["Environment"]["VISIONRL_ADAPTERS"] == (
        f"a1=s3://{BUCKET}/a1,a2=s3://{BUCKET}/a2"
    )
    assert calls[3][1] == {"EndpointName": "color", "EndpointConfigName": new}
    assert calls[5][1] == calls[6][1] == {"EndpointConfigName": part} and calls[7][1] == {"ModelName": part}
    client = _sagemaker()
    assert [m["ModelName"] for m in client.list_models()["Models"]] == [new]
    assert client.describe_endpoint(EndpointName="color")["EndpointConfigName"] == new

    calls.clear()
    assert main(["deploy", "sagemaker", "--name", "color", "--delete"]) == 0
    assert [op for op, _ in calls] == ["DescribeEndpoint", "DescribeEndpointConfig", "DeleteEndpoint",
                                       "DeleteEndpointConfig", "DeleteModel"]  # fmt: skip
    assert client.list_models()["Models"] == [] and client.list_endpoints()["Endpoints"] == []
    assert client.list_endpoint_configs()["EndpointConfigs"] == []


def test_a_damaged_adapter_stops_the_deploy_before_sagemaker(
    calls: list[tuple[str, dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _deploy("a1", "bad") == EXIT_BAD_INPUT
    assert "adapter_model.safetensors" in capsys.readouterr().err
    assert calls == []


def test_deleting_what_is_not_there_says_so(
    calls: list[tuple[str, dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["deploy", "sagemaker", "--name", "nothing-here", "--delete"]) == EXIT_BAD_INPUT
    assert "there is no endpoint 'nothing-here'" in capsys.readouterr().err
    assert [op for op, _ in calls] == ["DescribeEndpoint"]
