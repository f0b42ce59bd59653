"""Deterministic synthetic taps and messages for the daemon benchmark.

A capability is a (product, facet) pair such as ``datadog-logs`` or ``stripe-billing``;
its 6-12 triggers are drawn from the facet's verbs and objects, qualifiers and time
frames, with the product named in most of them ("tail the production error logs in
datadog"). Every capability gets a provider file with one stdio MCP server (the
product's, shared by the product's capabilities, as in real taps) and a ``default.toml``
symlink to it. The pair order is one fixed shuffle, so a smaller tap is a prefix of a
larger one: the same messages are meaningful at every size.

Everything derives from ``SEED`` and the capability's name (``random.Random`` seeded
with a string), so a tap of a given size is byte-identical on every machine and run.

Run: ``.venv/bin/python -m benchmarks.gen_tap --size 1000 --out /tmp/tap``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

SEED = 20240611
VERSION = 1  # bump when the generated text changes: cached taps and vectors are keyed on it

# (slug, how people write it). Real products first, then internal services of a large org.
PRODUCTS: tuple[tuple[str, str], ...] = tuple(
    (name.replace(" ", "-").replace(".", ""), name) for name in (
        "github", "gitlab", "bitbucket", "jira", "linear", "asana", "trello", "notion", "confluence", "slack",
        "discord", "microsoft teams", "zoom", "google calendar", "outlook", "gmail", "salesforce", "hubspot",
        "zendesk", "intercom", "freshdesk", "stripe", "paypal", "shopify", "quickbooks", "xero", "aws", "gcp",
        "azure", "digitalocean", "heroku", "vercel", "netlify", "cloudflare", "fastly", "datadog", "new relic",
        "grafana", "prometheus", "sentry", "pagerduty", "opsgenie", "splunk", "elasticsearch", "kibana",
        "postgres", "mysql", "mongodb", "redis", "snowflake", "bigquery", "redshift", "clickhouse", "dynamodb",
        "cassandra", "supabase", "firebase", "kubernetes", "docker", "terraform", "ansible", "jenkins",
        "circleci", "github actions", "buildkite", "argo cd", "helm", "vault", "1password", "okta", "auth0",
        "figma", "miro", "airtable", "google sheets", "excel", "dropbox", "box", "google drive", "onedrive",
        "s3", "mailchimp", "sendgrid", "twilio", "segment", "mixpanel", "amplitude", "looker", "tableau",
        "metabase", "launchdarkly", "statsig", "posthog", "hotjar", "typeform", "docusign", "calendly",
        "monday", "clickup", "basecamp", "todoist", "evernote", "obsidian", "coda", "webflow", "wordpress",
        "contentful", "sanity", "algolia", "meilisearch", "pinecone", "weaviate", "qdrant", "kafka", "rabbitmq",
        "sqs", "pubsub", "celery", "airflow", "dagster", "dbt", "fivetran", "databricks", "spark", "ray",
        "mlflow", "weights and biases", "hugging face", "openai", "anthropic", "replicate", "modal", "fly.io",
        "render", "railway", "nginx", "traefik", "consul", "nomad", "istio", "envoy", "jaeger", "honeycomb",
        "lightstep", "rollbar", "bugsnag", "logrocket", "fullstory", "browserstack", "playwright", "cypress",
        "selenium", "postman", "insomnia", "swagger", "npm", "pypi", "cargo", "maven", "gradle", "homebrew",
        "artifactory", "nexus", "sonarqube", "snyk", "dependabot", "renovate", "codecov", "coveralls",
        "crowdin", "lokalise", "deepl", "google maps", "mapbox", "openweather", "spotify", "youtube", "vimeo",
        "twitch", "reddit", "hacker news", "linkedin", "twitter", "mastodon", "bluesky", "telegram", "whatsapp",
        "signal", "matrix", "mattermost", "rocket.chat", "zulip", "front", "help scout", "gorgias", "klaviyo",
        "braze", "customer.io", "iterable", "netsuite", "sap", "workday", "bamboohr", "gusto", "rippling",
        "greenhouse", "lever", "expensify", "brex", "ramp", "plaid", "adyen", "braintree", "square", "chargebee",
        "recurly", "paddle", "orders service", "billing service", "inventory service", "search service",
        "auth service", "payments api", "shipping api", "catalog api", "recommendations service",
        "notifications service", "data warehouse", "feature store", "internal admin panel", "support console",
        "warehouse system", "fraud service", "pricing engine", "reporting service", "identity platform",
    )
)

# facet -> (verbs, objects). Objects are singular; a trailing "s" makes the plural.
FACETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "issues": (("create", "close", "reopen", "assign", "label", "triage", "comment on", "search for"),
               ("issue", "bug report", "ticket", "feature request", "epic")),
    "pull-requests": (("open", "review", "merge", "approve", "rebase", "comment on", "list"),
                      ("pull request", "code review", "merge request", "patch")),
    "deployments": (("deploy", "roll back", "promote", "pause", "check the status of", "restart"),
                    ("deployment", "release", "rollout", "build", "canary")),
    "logs": (("tail", "search", "filter", "export", "show me", "grep through"),
             ("log", "error log", "access log", "log line", "audit event")),
    "metrics": (("graph", "query", "compare", "show me", "break down"),
                ("latency metric", "cpu graph", "error rate", "p99 latency chart", "memory usage chart")),
    "alerts": (("acknowledge", "silence", "create", "resolve", "escalate", "mute"),
               ("alert", "incident", "pager alert", "alert rule", "monitor")),
    "databases": (("query", "migrate", "back up", "restore", "inspect", "index"),
                  ("table", "database", "schema", "row", "replica")),
    "storage": (("upload", "download", "list", "delete", "share", "sync"),
                ("file", "bucket", "folder", "object", "attachment")),
    "users": (("invite", "remove", "deactivate", "list", "change the role of"),
              ("user", "team member", "account", "admin", "guest")),
    "billing": (("refund", "charge", "look up", "cancel", "update"),
                ("invoice", "subscription", "payment", "customer", "plan")),
    "messages": (("send", "post", "reply to", "summarize", "search", "pin"),
                 ("message", "thread", "channel", "direct message", "announcement")),
    "calendar": (("schedule", "reschedule", "cancel", "find a slot for", "invite people to"),
                 ("meeting", "event", "standup", "call", "review session")),
    "documents": (("write", "edit", "summarize", "find", "export", "share"),
                  ("document", "page", "wiki page", "spec", "design doc")),
    "secrets": (("rotate", "read", "store", "revoke", "list"),
                ("secret", "api key", "token", "credential", "certificate")),
    "dashboards": (("build", "update", "share", "clone", "open"),
                   ("dashboard", "chart", "panel", "report", "widget")),
    "pipelines": (("run", "retry", "cancel", "debug", "inspect"),
                  ("pipeline", "ci job", "workflow run", "test suite", "nightly build")),
    "containers": (("build", "run", "stop", "inspect", "push"),
                   ("container", "image", "pod", "volume", "registry image")),
    "dns": (("add", "update", "delete", "check", "verify"),
            ("dns record", "domain", "cname record", "ssl certificate", "subdomain")),
    "analytics": (("analyze", "segment", "chart", "export", "compare"),
                  ("funnel", "cohort", "event stream", "conversion rate", "retention curve")),
    "contacts": (("add", "update", "merge", "find", "tag"),
                 ("contact", "lead", "deal", "company record", "opportunity")),
    "tasks": (("create", "complete", "move", "prioritize", "assign"),
              ("task", "todo", "card", "sprint item", "checklist")),
    "search": (("search", "find", "look up", "rank", "reindex"),
               ("search index", "query result", "document match", "synonym list", "search ranking")),
    "emails": (("draft", "send", "archive", "forward", "label"),
               ("email", "newsletter", "reply", "inbox rule", "mailing list")),
    "forms": (("create", "publish", "close", "export the answers of", "edit"),
              ("form", "survey", "questionnaire", "signup form", "poll")),
    "feature-flags": (("turn on", "turn off", "roll out", "target", "clean up"),
                      ("feature flag", "experiment", "toggle", "rollout rule", "variant")),
    "backups": (("take", "restore", "verify", "schedule", "delete"),
                ("backup", "snapshot", "restore point", "archive", "dump")),
    "permissions": (("grant", "revoke", "audit", "review", "copy"),
                    ("permission", "access policy", "role binding", "sharing setting", "group membership")),
    "webhooks": (("register", "delete", "replay", "test", "inspect"),
                 ("webhook", "callback url", "event subscription", "delivery", "signing secret")),
    "schedules": (("create", "pause", "trigger", "edit", "list"),
                  ("cron job", "scheduled task", "recurring job", "timer", "batch run")),
    "queues": (("drain", "purge", "inspect", "requeue", "peek at"),
               ("queue", "dead letter queue", "consumer group", "topic", "message backlog")),
    "cache": (("flush", "warm", "invalidate", "inspect", "resize"),
              ("cache", "cache key", "cdn cache", "edge cache", "session cache")),
    "models": (("train", "evaluate", "deploy", "fine-tune", "compare"),
               ("model", "checkpoint", "embedding model", "classifier", "prompt version")),
    "orders": (("look up", "cancel", "refund", "ship", "update"),
               ("order", "cart", "return", "purchase", "shipment")),
    "inventory": (("count", "restock", "reserve", "adjust", "audit"),
                  ("inventory item", "sku", "stock level", "warehouse bin", "product variant")),
    "support": (("answer", "escalate", "close", "merge", "assign"),
                ("support ticket", "customer conversation", "chat", "complaint", "help request")),
    "knowledge-base": (("write", "update", "publish", "search", "retire"),
                       ("help article", "faq", "runbook", "how-to guide", "troubleshooting note")),
    "spreadsheets": (("update", "sort", "fill in", "add a formula to", "export"),
                     ("spreadsheet", "sheet", "cell range", "pivot table", "column")),
    "designs": (("export", "comment on", "duplicate", "inspect", "hand off"),
                ("design", "mockup", "frame", "component", "prototype")),
    "notes": (("write", "append to", "find", "tag", "summarize"),
              ("note", "meeting note", "journal entry", "scratchpad", "daily note")),
    "locations": (("find", "geocode", "route to", "measure the distance to", "map"),
                  ("address", "location", "store location", "delivery zone", "route")),
    "translations": (("translate", "review", "sync", "upload", "approve"),
                     ("translation", "string", "locale file", "glossary term", "localized page")),
    "payroll": (("run", "review", "approve", "correct", "export"),
                ("payroll run", "payslip", "timesheet", "bonus", "expense report")),
    "hiring": (("schedule", "review", "advance", "reject", "source"),
               ("candidate", "interview", "job posting", "offer", "scorecard")),
    "packages": (("publish", "upgrade", "pin", "audit", "yank"),
                 ("package", "dependency", "release version", "lockfile", "library")),
    "security": (("scan", "triage", "patch", "suppress", "report"),
                 ("vulnerability", "security finding", "cve", "dependency alert", "code scanning result")),
    "videos": (("upload", "trim", "transcribe", "publish", "caption"),
               ("video", "recording", "clip", "livestream", "transcript")),
    "social": (("post", "schedule", "reply to", "delete", "analyze"),
               ("post", "tweet", "mention", "comment", "campaign post")),
    "networking": (("open", "close", "trace", "debug", "allowlist"),
                   ("port", "firewall rule", "load balancer", "vpc peering", "ip range")),
}

QUALIFIERS = ("staging", "production", "last week's", "open", "failed", "new", "urgent", "archived", "shared",
              "recent", "critical", "stale", "flaky", "duplicate", "high priority", "customer-facing", "internal",
              "pending", "weekly", "q3")
TIMEFRAMES = ("from yesterday", "for this sprint", "since monday", "in the last hour", "from last night",
              "for the release", "before friday", "for the eu region", "on the main branch", "for team alpha")
DOMAINS = ("developer", "devops", "data", "productivity", "communication", "finance", "sales", "support",
           "security", "design", "marketing", "people")

TRIGGER_TEMPLATES = (
    "{verb} the {object} in {product}",
    "{verb} a {qualifier} {object} on {product}",
    "{verb} the {qualifier} {product} {objects} {timeframe}",
    "show me the {qualifier} {objects} in {product}",
    "{verb} {object} {timeframe} in {product}",
    "can you {verb} the {object} in {product} for me",
    "{product} {objects} {timeframe}",
    "help me {verb} {qualifier} {objects} using {product}",
    "{verb} every {qualifier} {object} in {product}",
    "list {objects} {timeframe} from {product}",
    "I want to {verb} a {object} in {product}",
    "{verb} the {product} {object} and tell me what changed",
)

MESSAGE_TEMPLATES = (
    "hey, could you {verb} the {qualifier} {object} in {product}? {tail}",
    "we need to {verb} a few {qualifier} {objects} {timeframe}, can you do that in {product}",
    "{tail_cap} please {verb} the {object} over in {product} {timeframe}",
    "quick one: {verb} {qualifier} {objects} in {product} and summarize what you find",
    "before standup I'd like you to {verb} the {objects} {timeframe} from {product}",
    "can you check {product} and {verb} any {qualifier} {object} that looks wrong",
    "my manager asked me to {verb} the {qualifier} {object} {timeframe}; use {product} for it",
    "I think something broke, {verb} the {objects} in {product} {timeframe} and tell me why",
)
TAILS = ("thanks!", "it's for the release on friday.", "no rush.", "this is blocking the team.",
         "ping me when it's done.", "the customer is waiting.", "keep it short.", "same as last time.")
CHITCHAT = ("thanks, that looks great, really appreciate the help today", "how was your weekend, do anything fun?",
            "what's a good name for a golden retriever puppy", "tell me a joke about programmers and coffee",
            "can you explain what a monad is in simple words", "write a haiku about autumn leaves falling",
            "what is the capital of australia and why isn't it sydney", "good morning! ready for another day?")


def _plural(noun: str) -> str:
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2:-1] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def pairs() -> list[tuple[str, str, str]]:
    """Every (capability name, product words, facet) in the one fixed order taps take prefixes of."""
    out = [(f"{slug}-{facet}", words, facet) for slug, words in PRODUCTS for facet in FACETS]
    random.Random(f"{SEED}:pairs").shuffle(out)
    return out


def _fill(template: str, rng: random.Random, product: str, facet: str) -> str:
    verbs, objects = FACETS[facet]
    obj = rng.choice(objects)
    tail = rng.choice(TAILS)
    return " ".join(template.format(verb=rng.choice(verbs), object=obj, objects=_plural(obj), product=product,
                                    qualifier=rng.choice(QUALIFIERS), timeframe=rng.choice(TIMEFRAMES),
                                    tail=tail, tail_cap=tail.capitalize()).split())


def triggers_for(name: str, product: str, facet: str) -> list[str]:
    rng = random.Random(f"{SEED}:{name}")
    count = rng.randint(6, 12)
    out: list[str] = []
    templates = list(TRIGGER_TEMPLATES)
    rng.shuffle(templates)
    while len(out) < count:
        text = _fill(templates[len(out) % len(templates)], rng, product, facet)
        if text not in out:
            out.append(text)
    return out


def _toml_list(items: list[str]) -> str:
    return "[\n" + "".join(f"    {json.dumps(t)},\n" for t in items) + "]"


def _write_capability(root: Path, name: str, product: str, facet: str) -> None:
    folder = root / "capabilities" / name
    folder.mkdir(parents=True)
    rng = random.Random(f"{SEED}:{name}:meta")
    domains = sorted(rng.sample(DOMAINS, rng.randint(1, 2)))
    slug = name[: -len(facet) - 1]
    description = f"Works with {facet.replace('-', ' ')} in {product}."
    (folder / "config.toml").write_text(
        f"triggers = {_toml_list(triggers_for(name, product, facet))}\n"
        f"domains = {json.dumps(domains)}\ndescription = {json.dumps(description)}\n", encoding="utf-8")
    (folder / f"{slug}.toml").write_text(
        f"# Title: {product.title()} {facet.replace('-', ' ')}\n# Description: {description}\n"
        f'[deps]\nrequire = ["example/{slug}-mcp"]\n\n[roles.mcp]\nserver_refs = ["{slug}"]\n'
        f'allowed_tools = ["{slug}:*"]\n\n[[mcp.servers]]\nname = "{slug}"\ntype = "stdio"\ncommand = "npx"\n'
        f'args = ["-y", "@example/{slug}-mcp@1.0.0", "{{{{ENV:{slug.upper().replace("-", "_")}_TOKEN}}}}"]\n'
        "timeout_seconds = 30\ntools = []\n", encoding="utf-8")
    os.symlink(f"{slug}.toml", folder / "default.toml")


def write_tap(size: int, out: Path) -> Path:
    """Write a tap of ``size`` capabilities into ``out`` (which must not exist)."""
    every = pairs()
    if not 0 < size <= len(every):
        raise ValueError(f"size must be between 1 and {len(every)}")
    for name, product, facet in every[:size]:
        _write_capability(out, name, product, facet)
    return out


def cached_tap(size: int, cache: Path) -> Path:
    """The tap of ``size`` under ``cache`` (written once, atomically; reused while VERSION holds)."""
    final = cache / f"tap-{size}-s{SEED}-v{VERSION}"
    if (final / "capabilities").is_dir():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"tap-{size}-", dir=cache))
    try:
        write_tap(size, scratch / "tap")
        try:
            (scratch / "tap").rename(final)
        except OSError:  # another run finished the same tap first
            if not (final / "capabilities").is_dir():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return final


def messages(count: int, tap_size: int = 60, seed: int = SEED, chitchat_share: float = 0.1) -> list[str]:
    """``count`` distinct user messages: most ask for one of the first ``tap_size`` capabilities."""
    rng = random.Random(f"{seed}:messages:{tap_size}")
    targets = pairs()[:tap_size]
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < count:
        if rng.random() < chitchat_share:
            text = f"{rng.choice(CHITCHAT)} ({rng.choice(TAILS)[:-1]})"
        else:
            _, product, facet = rng.choice(targets)
            text = _fill(rng.choice(MESSAGE_TEMPLATES), rng, product, facet)
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=60, help="number of capabilities (default 60)")
    parser.add_argument("--out", type=Path, required=True, help="directory to create")
    args = parser.parse_args()
    write_tap(args.size, args.out)
    print(f"wrote {args.size} capabilities to {args.out}")


if __name__ == "__main__":
    main()
