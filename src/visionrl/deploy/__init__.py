"""Deploying a trained adapter to a cloud's serving: `sagemaker` (a SageMaker real-time endpoint, `visionrl deploy
sagemaker`)."""
