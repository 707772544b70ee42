"""Ray settings (section `ray`, env prefix `TOOLENV_RAY_`): where the cluster is, and how many
replicas of each deployment run where. Kept outside `toolenv.ray` so `config show` needs no Ray.

Each deployment's replicas are sized by `num_cpus` (Ray places them where that much CPU is free,
so it is also "replicas per node": a node with 8 CPUs takes 8 sandbox replicas of 1 CPU) and
`max_ongoing_requests` (the calls one replica runs at once; for a sandbox, its process pool
size). With `min_replicas < max_replicas` Ray Serve autoscales on the calls queued and running
per replica against `target_ongoing_requests`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import SettingsConfigDict

from toolenv_core.config import ServiceSettings
from toolenv_core.fields import Integer, Number


class ReplicaConfig(BaseModel):
    """One deployment's replicas: size, per-replica concurrency, count or autoscaling bounds."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    num_cpus: Number = Field(default=1.0, ge=0, description="CPUs reserved per replica")
    resources: dict[str, Number] = Field(
        default_factory=dict, description='custom resources per replica, e.g. {"sandbox_node": 1}'
    )
    max_ongoing_requests: Integer = Field(default=16, ge=1, description="calls one replica runs")
    min_replicas: Integer = Field(default=1, ge=0)
    max_replicas: Integer = Field(default=1, ge=1)
    target_ongoing_requests: Number = Field(
        default=8.0, gt=0, description="autoscaling: queued + running calls per replica"
    )
    upscale_delay_s: Number = Field(default=2.0, ge=0)
    downscale_delay_s: Number = Field(default=20.0, ge=0)
    max_replicas_per_node: Integer | None = Field(default=None, ge=1)
    metrics_interval_s: Number = Field(
        default=0.5, gt=0, description="autoscaling: how often queue lengths are reported"
    )
    look_back_period_s: Number = Field(
        default=2.0, gt=0, description="autoscaling: the window queue lengths are averaged over"
    )

    @model_validator(mode="after")
    def _bounds(self) -> ReplicaConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas exceeds max_replicas")
        if self.autoscaling and self.look_back_period_s <= self.metrics_interval_s:
            # Serve took it with a FutureWarning in the deploying command's output ("will raise
            # an exception in a future release"); docs/ray.md advises longer intervals at scale.
            raise ValueError(
                f"look_back_period_s ({self.look_back_period_s}) must exceed metrics_interval_s "
                f"({self.metrics_interval_s}): the queue lengths reported each interval are "
                "averaged over the look-back window"
            )
        return self

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas < self.max_replicas

    def deployment_options(self) -> dict[str, Any]:
        """Keyword arguments for `Deployment.options(...)`."""
        actor: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.resources:
            actor["resources"] = dict(self.resources)
        options: dict[str, Any] = {
            "ray_actor_options": actor,
            "max_ongoing_requests": self.max_ongoing_requests,
        }
        if self.max_replicas_per_node is not None:
            options["max_replicas_per_node"] = self.max_replicas_per_node
        if self.autoscaling:
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas,
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
                "metrics_interval_s": self.metrics_interval_s,
                "look_back_period_s": self.look_back_period_s,
            }
        else:
            options["num_replicas"] = self.max_replicas
        return options


class RaySettings(ServiceSettings):
    model_config = SettingsConfigDict(
        env_prefix="TOOLENV_RAY_", extra="ignore", env_nested_delimiter="__"
    )
    section: ClassVar[str] = "ray"

    address: str | None = Field(
        default=None, description='cluster address ("auto", "HOST:PORT"); None: a local cluster'
    )
    # Serve refuses an empty name, but only once a cluster has started (a traceback)
    app_name: str = Field(default="toolenv", min_length=1, description="the Serve application")
    http_host: str = Field(
        default="127.0.0.1", description="where each gateway replica listens, on its node"
    )
    http_port: Integer = Field(default=8000, ge=1, le=65535)
    gateway: ReplicaConfig = Field(
        default_factory=lambda: ReplicaConfig(num_cpus=0.5, max_ongoing_requests=4096)
    )
    sandbox: ReplicaConfig = Field(
        default_factory=lambda: ReplicaConfig(num_cpus=1.0, max_ongoing_requests=16)
    )
    emulators: ReplicaConfig = Field(
        default_factory=lambda: ReplicaConfig(num_cpus=0.25, max_ongoing_requests=1024)
    )

    @model_validator(mode="after")
    def _an_entry_point(self) -> RaySettings:
        # The gateway replicas are the HTTP entry point and Serve scales on calls its own router
        # sees: with none running, no call ever arrives to scale them up from zero.
        if self.gateway.min_replicas < 1:
            raise ValueError(
                "gateway.min_replicas must be at least 1: the gateway replicas serve HTTP "
                "themselves, so none would ever start to take the first call"
            )
        return self
