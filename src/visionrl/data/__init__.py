"""Prompt data: the user's JSONL/Parquet datasets, batch sampling, and synthetic visual tasks for the demo."""

from visionrl.data.dataset import DatasetError, Sample, VisionDataset, load_dataset
from visionrl.data.sampler import PromptSampler
from visionrl.data.synthetic import TASKS, list_tasks, make_dataset, task_vocabulary

__all__ = [
    "TASKS",
    "DatasetError",
    "PromptSampler",
    "Sample",
    "VisionDataset",
    "list_tasks",
    "load_dataset",
    "make_dataset",
    "task_vocabulary",
]
