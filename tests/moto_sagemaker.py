"""moto's server with SageMaker's UpdateEndpoint added, which moto 5.2 lacks: the endpoint moves to the new config
(its variants and their models) and is InService again, as SageMaker's blue/green update ends. Run as
`python tests/moto_sagemaker.py -H 127.0.0.1 -p PORT` (tests.aws_local.moto_server(..., update_endpoint=True))."""

from __future__ import annotations

import sys
from typing import Any


def _update_endpoint(self: Any) -> Any:
    from moto.core.responses import ActionResult

    backend = self.sagemaker_backend
    name, config_name = self._get_param("EndpointName"), self._get_param("EndpointConfigName")
    endpoint = backend.endpoints[name]
    config = backend.describe_endpoint_config(config_name)
    endpoint.endpoint_config_name = config_name
    endpoint.production_variants = endpoint._process_production_variants(config["ProductionVariants"])
    endpoint.endpoint_status = "InService"
    return ActionResult({"EndpointArn": endpoint.arn})


if __name__ == "__main__":
    from moto.sagemaker.responses import SageMakerResponse
    from moto.server import main

    SageMakerResponse.update_endpoint = _update_endpoint  # type: ignore[attr-defined]
    sys.exit(main(sys.argv[1:]))
