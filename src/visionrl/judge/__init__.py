"""Judges: a model that scores completions (the `judge` reward). The spec, templates and verdicts are in
`rewards.judge`; here are the judges that run a model: a judge model's own engine (`model`), an
OpenAI-compatible endpoint (`endpoint`). The run's judging (cache, deadlines, counters) is `orchestrate.judging`."""
