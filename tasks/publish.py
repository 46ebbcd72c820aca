"""The single publisher as a task: built conversations in, one snapshot out (the flow process only)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tmem.build.conversation import ConversationBuild
from tmem.build.publish import publish_builds
from tmem.build.runtime import runtime_for
from tmem.build.spec import BuildSpec


@task(name="publish", task_run_name="publish/{run_id}", cache_policy=NO_CACHE)
def publish(spec: BuildSpec, run_id: str, builds: dict[str, ConversationBuild]) -> str:
    """Write the built conversations and flip the snapshot pointer; the snapshot id."""
    return publish_builds(runtime_for(spec, run_id), builds)
