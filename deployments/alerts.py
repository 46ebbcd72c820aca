"""Alert when the nightly rebuild fails: a Prefect automation on Failed and Crashed runs of the deployment.

    python deployments/alerts.py --webhook-url https://hooks.slack.com/services/...   # a webhook block is made
    python deployments/alerts.py --block slack-webhook/oncall                        # or any notification block
    python deployments/alerts.py --deployment nightly-rebuild/nightly-rebuild --dry-run  # print it, create nothing

Run against the server the deployment lives on (``PREFECT_API_URL``), after ``prefect deploy`` (or
``deployments/serve.py``) created the deployment. It creates — or, run again, replaces — the
automation ``tmem-nightly-failed``: a reactive event trigger on ``prefect.flow-run.Failed`` and
``prefect.flow-run.Crashed`` whose related resource is that deployment, with one action, a
notification through the block naming the flow run, its state and message and a link to it.
``--webhook-url`` stores a ``Custom Webhook`` notification block ``tmem-nightly-alerts`` that POSTs
``{"text": subject + body}`` (what Slack and Mattermost incoming webhooks accept).
The server evaluates the trigger and sends the notification itself: no worker needs to be up. The
link in the notification is built from the server's ``PREFECT_UI_URL`` (start the server with it,
e.g. ``PREFECT_UI_URL=http://prefect.internal:4200``); without it the body names the run's id.
"""

from __future__ import annotations

import argparse
import json
from datetime import timedelta
from typing import Any
from uuid import UUID

AUTOMATION = "tmem-nightly-failed"
WEBHOOK_BLOCK = "tmem-nightly-alerts"
DEFAULT_DEPLOYMENT = "nightly-rebuild/nightly-rebuild"
FAILED_EVENTS = ("prefect.flow-run.Failed", "prefect.flow-run.Crashed")
SUBJECT = "tmem nightly {{ flow_run.name }}: {{ flow_run.state.name }}"
# The link needs the server to know its UI address (PREFECT_UI_URL, or PREFECT_API_URL, in the server's
# environment); without it ``ui_url`` renders None, so the body names the run's id instead.
BODY = ("Flow run {{ flow_run.name }} of deployment {{ deployment.name }} ended {{ flow_run.state.name }}: "
        "{{ flow_run.state.message }}\n{{ flow_run|ui_url or ('flow run id ' ~ flow_run.id) }}")


def webhook_block(url: str) -> UUID:
    """Save the Custom Webhook notification block ``tmem-nightly-alerts`` posting to ``url``; its id."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    block = CustomWebhookNotificationBlock(name=WEBHOOK_BLOCK, url=url, json_data={"text": "{{subject}}\n{{body}}"},
                                           cookies=None, headers=None)
    saved: Any = block.save(WEBHOOK_BLOCK, overwrite=True)
    return UUID(str(saved))


def block_id(slug: str) -> UUID:
    """The id of a saved block named ``<block type slug>/<name>``, e.g. ``slack-webhook/oncall``."""
    from prefect.blocks.core import Block

    block: Any = Block.load(slug)
    return UUID(str(block._block_document_id))


def nightly_automation(deployment_id: UUID, notification_block: UUID, deployment: str = DEFAULT_DEPLOYMENT) -> Any:
    """The automation (not yet saved)."""
    from prefect.automations import Automation, EventTrigger, Posture, SendNotification

    return Automation(
        name=AUTOMATION,
        description=f"Notify when a run of {deployment} fails or crashes (deployments/alerts.py).",
        trigger=EventTrigger(
            expect=set(FAILED_EVENTS),
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.id": f"prefect.deployment.{deployment_id}"},
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(0),
        ),
        actions=[SendNotification(block_document_id=notification_block, subject=SUBJECT, body=BODY)],
    )


def create_nightly_alert(deployment: str = DEFAULT_DEPLOYMENT, *, webhook_url: str | None = None,
                         block: str | None = None) -> Any:
    """Create (replacing one of the same name) the automation for ``deployment``; returns it, saved."""
    from prefect.client.orchestration import get_client

    if (webhook_url is None) == (block is None):
        raise SystemExit("give exactly one of --webhook-url and --block")
    target = webhook_block(webhook_url) if webhook_url is not None else block_id(str(block))
    with get_client(sync_client=True) as client:
        found = client.read_deployment_by_name(deployment)
        for old in client.read_automations_by_name(name=AUTOMATION):  # run again: replaced, not doubled
            client.delete_automation(old.id)
    return nightly_automation(found.id, target, deployment).create()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deployment", default=DEFAULT_DEPLOYMENT, help="<flow name>/<deployment name>")
    parser.add_argument("--webhook-url", help="make a Custom Webhook notification block posting to this URL")
    parser.add_argument("--block", help="an existing notification block, <block type slug>/<name>")
    parser.add_argument("--dry-run", action="store_true", help="print the automation, create nothing")
    args = parser.parse_args()
    if args.dry_run:
        zero = UUID(int=0)
        print(json.dumps(nightly_automation(zero, zero, args.deployment).model_dump(mode="json"), indent=1))
        return
    automation = create_nightly_alert(args.deployment, webhook_url=args.webhook_url, block=args.block)
    print(f"automation {automation.name} ({automation.id}): notify on {', '.join(FAILED_EVENTS)} of {args.deployment}")


if __name__ == "__main__":
    main()
