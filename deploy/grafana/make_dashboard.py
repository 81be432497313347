"""Writes the Grafana dashboard deploy/grafana/raystream.json from the series that
raystream/metrics_export.py exports. Run from the repository root:
``python deploy/grafana/make_dashboard.py``."""

import json

DS = {"type": "prometheus", "uid": "${datasource}"}
panels = []


def panel(title, exprs, unit, x, y, w=12, h=8, kind="timeseries"):
    pid = len(panels) + 1
    targets = [
        {"datasource": DS, "expr": e, "legendFormat": lf, "refId": chr(65 + i)}
        for i, (e, lf) in enumerate(exprs)
    ]
    panels.append(
        {
            "id": pid,
            "type": kind,
            "title": title,
            "datasource": DS,
            "gridPos": {"x": x, "y": y, "w": w, "h": h},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {
                "legend": {"displayMode": "table", "placement": "bottom", "showLegend": True}
            },
            "targets": targets,
        }
    )


J = 'job=~"$job"'
S = 'job=~"$job", step=~"$step"'
LAT = f"rate(ray_raystream_sink_latency_ms_total{{{S}}}[1m])"
panel(
    "Records in per second, by step",
    [(f"sum by (step) (rate(ray_raystream_records_in_total{{{S}}}[1m]))", "{{step}}")],
    "ops",
    0,
    0,
)
panel(
    "Records out per second, by step",
    [(f"sum by (step) (rate(ray_raystream_records_out_total{{{S}}}[1m]))", "{{step}}")],
    "ops",
    12,
    0,
)
panel(
    "End-to-end latency at the sinks (all instances)",
    [
        (
            f"histogram_quantile({q}, sum by (le) ({LAT}))",
            f"p{int(q * 100)}",
        )
        for q in (0.5, 0.9, 0.99)
    ]
    + [
        (
            f"sum(rate(ray_raystream_sink_latency_ms_sum_total{{{S}}}[1m])) / "
            f'sum(rate(ray_raystream_sink_latency_ms_total{{{S}, le="+Inf"}}[1m]))',
            "mean",
        )
    ],
    "ms",
    0,
    8,
)
panel(
    "Busy share per instance",
    [(f"rate(ray_raystream_busy_seconds_total{{{S}}}[1m])", "{{step}}/{{index}}")],
    "percentunit",
    12,
    8,
)
panel(
    "Backlog (batches queued) per instance",
    [(f"ray_raystream_backlog_batches{{{S}}}", "{{step}}/{{index}}")],
    "short",
    0,
    16,
)
panel(
    "Parallelism (live instances) by step",
    [(f"sum by (step) (ray_raystream_instance_up{{{S}}})", "{{step}}")],
    "short",
    12,
    16,
)
panel(
    "Keyed state per instance",
    [(f"ray_raystream_state_bytes{{{S}}}", "{{step}}/{{index}}")],
    "bytes",
    0,
    24,
)
panel(
    "Keyed state by step",
    [(f"sum by (step) (ray_raystream_state_bytes{{{S}}})", "{{step}}")],
    "bytes",
    12,
    24,
)
panel(
    "Checkpoints, rescales and recoveries per minute",
    [
        (f"sum(rate(ray_raystream_{n}_total{{{J}}}[5m])) * 60", n)
        for n in ("checkpoints", "rescales", "recoveries")
    ],
    "short",
    0,
    32,
)
panel(
    "Mean duration over 5 minutes",
    [
        (
            f"sum(rate(ray_raystream_{e}_seconds_total{{{J}}}[5m])) / "
            f"sum(rate(ray_raystream_{n}_total{{{J}}}[5m]))",
            e,
        )
        for e, n in (
            ("checkpoint", "checkpoints"),
            ("rescale", "rescales"),
            ("recovery", "recoveries"),
        )
    ],
    "s",
    12,
    32,
)
panel(
    "Last checkpoint, rescale and recovery",
    [
        (f"ray_raystream_checkpoint_duration_s{{{J}}}", "checkpoint {{job}}"),
        (f"ray_raystream_rescale_duration_s{{{J}}}", "rescale {{job}}"),
        (f"ray_raystream_recovery_downtime_s{{{J}}}", "recovery downtime {{job}}"),
    ],
    "s",
    0,
    40,
    w=24,
)


def var(name, query, multi=True):
    return {
        "name": name,
        "type": "query",
        "datasource": DS,
        "query": query,
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "multi": multi,
        "current": {"text": "All", "value": "$__all"},
        "allValue": ".*",
    }


dashboard = {
    "title": "raystream",
    "uid": "raystream",
    "description": "Operator throughput, busy share, backlog, parallelism, sink latency "
    "quantiles, keyed state, checkpoints, rescales and recoveries of raystream jobs (series "
    "exported through Ray's metrics; see raystream/metrics_export.py).",
    "tags": ["raystream", "ray", "streaming"],
    "timezone": "browser",
    "schemaVersion": 39,
    "version": 1,
    "refresh": "10s",
    "time": {"from": "now-30m", "to": "now"},
    "templating": {
        "list": [
            {
                "name": "datasource",
                "type": "datasource",
                "query": "prometheus",
                "current": {},
                "hide": 0,
            },
            var("job", "label_values(ray_raystream_instance_up, job)"),
            var("step", 'label_values(ray_raystream_instance_up{job=~"$job"}, step)'),
        ]
    },
    "panels": panels,
    "annotations": {"list": []},
}
with open("deploy/grafana/raystream.json", "w") as f:
    json.dump(dashboard, f, indent=2)
    f.write("\n")
