"""`visionrl.deploy.sagemaker` without a SageMaker: what a spec is checked for, the container it describes, how the
wait ends when an endpoint fails or takes too long, and botocore's errors as one line. The requests themselves are
checked against a local SageMaker in tests/integration/test_deploy_sagemaker.py."""

from __future__ import annotations

from typing import Any

import pytest

from visionrl.deploy.sagemaker import EndpointSpec, aws_errors, wait_in_service
from visionrl.errors import InputError, RunError

ROLE = "arn:aws:iam::123456789012:role/r"


def test_a_spec_names_every_problem() -> None:
    spec = EndpointSpec(name="bad name!", image="", role="my-role", base="s3://b/m", instance_count=0,
                        adapters={"a1": "/local/a1"})  # fmt: skip
    with pytest.raises(InputError) as err:
        spec.check()
    lines = str(err.value).splitlines()[1:]
    assert [line.strip()[2:].split(":")[0] for line in lines] == [
        "--name 'bad name!'", "--image", "--role 'my-role'", "--instance-count 0", "adapter a1=/local/a1",
    ]  # fmt: skip
    EndpointSpec(name="color-v2", image="img", role=ROLE, base="s3://b/m").check()
    with pytest.raises(InputError, match="at most 43 characters"):
        EndpointSpec(name="x" * 44, image="img", role=ROLE, base="s3://b/m").check()


def test_a_base_inside_the_image_goes_by_the_environment() -> None:
    spec = EndpointSpec(name="e", image="img", role=ROLE, base="/models/qwen3-vl-8b", environment={"K": "v"})
    assert spec.container() == {
        "Image": "img",
        "Environment": {"K": "v", "VISIONRL_BASE_MODEL": "/models/qwen3-vl-8b"},
    }
    s3 = EndpointSpec(name="e", image="img", role=ROLE, base="s3://b/models/q")
    assert s3.container()["ModelDataSource"]["S3DataSource"]["S3Uri"] == "s3://b/models/q/"


class _Endpoint:
    """describe_endpoint answers in turn."""

    def __init__(self, *answers: dict[str, Any]) -> None:
        self.answers = list(answers)

    def describe_endpoint(self, EndpointName: str) -> dict[str, Any]:
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_waiting_ends_with_sagemakers_reason_or_the_deadline() -> None:
    heard: list[str] = []
    client = _Endpoint({"EndpointStatus": "Creating"}, {"EndpointStatus": "Creating"},
                       {"EndpointStatus": "Failed", "FailureReason": "The primary container did not pass the ping"})  # fmt: skip
    with pytest.raises(RunError) as err:
        wait_in_service(client, "color", poll_s=0, wait_s=60, say=heard.append)
    assert "endpoint color failed: The primary container did not pass the ping" in str(err.value)
    assert "/aws/sagemaker/Endpoints/color" in str(err.value) and "--name color --delete" in str(err.value)
    assert heard == ["endpoint color: Creating (0 s)"]  # a status is said once, when it changes
    with pytest.raises(RunError, match="endpoint color is still Updating after 0 s"):
        wait_in_service(
            _Endpoint({"EndpointStatus": "Updating"}), "color", poll_s=0, wait_s=0, say=heard.append
        )


def test_aws_errors_are_one_line() -> None:
    import botocore.exceptions as bx

    denied = bx.ClientError(
        {"Error": {"Code": "AccessDeniedException", "Message": "not allowed"}}, "CreateModel"
    )
    with pytest.raises(
        RunError, match=r"deploying: SageMaker refused \(AccessDeniedException\).*docs/AWS.md"
    ):
        with aws_errors("deploying"):
            raise denied
    with pytest.raises(InputError, match="deploying: Unable to locate credentials. Set AWS credentials"):
        with aws_errors("deploying"):
            raise bx.NoCredentialsError()
