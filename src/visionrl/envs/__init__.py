"""Multi-turn episodes: the environment interface user code implements, and the built-in environments.

```python
from visionrl.envs import Env, Observation, StepResult

class MyEnv(Env):
    def reset(self, record: dict) -> Observation: ...   # the first user turn: Observation(text, images)
    def step(self, action: str) -> StepResult: ...      # StepResult(observation | None, reward, done, info)
```

`reset` gets the data record (its fields as read, plus `prompt`: the question's text, `images`: its images loaded,
`answer`); `step` gets the model's text of the turn. An episode's return is the sum of its step rewards plus the
job's `rewards` on the final turn's text. One env object per episode (job file: `env: {name, kwargs, max_turns,
max_images}`); a `step` that raises or overruns `env.step_timeout_s` ends its episode with reward 0, counted.
Built-in: `tools` (the job's `env.tools`, called in the Qwen chat template's tool-call format), `calculator`,
`zoom` and `maze`.
"""

from visionrl.envs.base import Env, Observation, StepResult

__all__ = ["Env", "Observation", "StepResult"]
