"""A silo's own configuration (written by `fedsilo silo init`, owned by the hospital's IT team):
where its kit and data are, which device it trains on, where it serves metrics, and the local
rules a deployment policy must satisfy before this silo takes part.

The rules are checked when the silo joins: a policy that breaks one is refused with a message
naming the rule, and the coordinator shows that reason for this silo.

Every key of silo.yaml (relative paths start at silo.yaml's folder):

```yaml
version: 1                      # the format's version
kit: /srv/fedsilo/kit           # this silo's kit folder (from `fedsilo provision`)
coordinator:                    # how this silo reaches its coordinator (silo/proxy.py)
  proxy: http://proxy.hospital:3128  # an HTTP CONNECT proxy (mTLS runs through it), or
                                # `direct`; absent: https_proxy and no_proxy as gRPC reads them
data:
  source:                       # a data section, as a policy's `data:` (policies/data.py)
    source: csv                 # csv or npz for a site's own file
    path: records.csv
    target: outcome             # the label column
    categorical: {smoker: ["no", "yes"]}  # text columns and their agreed categories
    missing: impute             # or error (the default): impute missing values locally
    missing_values: {chol: [0]} # values that mean "not measured"
    drop_columns: [patient_id]  # columns that are not features
    split: {train: 0.8, val: 0.1, test: 0.1}
    scaling: local              # local, federated or none
    # partition: absent for a site's own file, which is one silo
  select: null                  # which silo of a multi-silo section (demo data) this is
compute: {device: cpu}          # overrides the policy's placement at this site
metrics_port: 9465              # Prometheus metrics on 127.0.0.1
rules:                          # LocalRules: what this site allows
  allowed_algorithms: [fedavg, fedprox]
  max_rounds: 100
  require_dp: false
  epsilon_cap: 8.0
  total_epsilon_cap: 20.0       # this site's epsilon over all jobs of the consortium
  allowed_reports: null         # None: every report kind the policy allows
  allowed_model_factories: []   # plugin models (module:attr of fedsilo.models) this site runs
  forbid_data_releases: false   # refuse algorithms that send data-like point clouds (feddro)
ledger: privacy-ledger.jsonl    # this site's privacy ledger
state: silo-state               # what outlives the agent
```

`fedsilo silo check --config silo.yaml` (ops/silo_check.py) loads the data as the agent will.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator

from fedsilo.policies.base import PolicyModel
from fedsilo.policies.compute import ComputeConfig
from fedsilo.policies.data import SITE_SOURCES, DataConfig, IidPartition
from fedsilo.policies.loading import PolicyError, describe_errors, read_text_file, read_yaml
from fedsilo.policies.model import PluginModel
from fedsilo.policies.privacy import REPORT_KINDS, ReportKind
from fedsilo.policies.schema import Policy
from fedsilo.silo.data import DataError, SiloDataset, load_consortium
from fedsilo.silo.proxy import DIRECT, check_proxy_url


class LocalRules(PolicyModel):
    """What this site allows, in the spirit of NVFLARE's site privacy scopes.

    `require_dp`: only DP deployments (DP-SGD, noisy reports); `epsilon_cap`: this site's own
    budget per job, enforced by its ledger beside the policy's (the stricter wins), and
    so only for DP jobs; `total_epsilon_cap`: this site's budget over all jobs of the
    consortium (the jobs' epsilons add up), which no peer enforces; a job without DP spends
    none of it; `allowed_reports`: the kinds of scalar report that may leave;
    `allowed_model_factories`: the plugin model factories (entry point values `module:attr`
    of group `fedsilo.models`) this site runs; none by default; `forbid_data_releases`: refuse
    algorithms that send data-like releases (FedDRO's point clouds built from the records).
    """

    allowed_algorithms: list[str] | None = None  # None: any algorithm
    max_rounds: int | None = Field(default=None, ge=1)
    require_dp: bool = False
    epsilon_cap: float | None = Field(default=None, gt=0)
    total_epsilon_cap: float | None = Field(default=None, gt=0)
    allowed_reports: list[ReportKind] | None = None  # None: every kind the policy allows
    allowed_model_factories: list[str] = Field(default_factory=list)
    forbid_data_releases: bool = False

    def violations(self, policy: Policy) -> list[str]:
        """Each rule the policy breaks, as `rule: why`."""
        problems = []
        if (
            self.allowed_algorithms is not None
            and policy.algorithm.name not in self.allowed_algorithms
        ):
            problems.append(
                f"allowed_algorithms: {policy.algorithm.name!r} is not in {self.allowed_algorithms}"
            )
        if self.max_rounds is not None and policy.rounds > self.max_rounds:
            problems.append(f"max_rounds: the policy asks for {policy.rounds} > {self.max_rounds}")
        private = policy.privacy.differentially_private
        if self.require_dp and not private:
            problems.append("require_dp: the policy trains without DP (no privacy.dp_sgd)")
        if self.epsilon_cap is not None and not private:
            problems.append(
                f"epsilon_cap: the policy's releases have no DP guarantee, so no epsilon to "
                f"hold to {self.epsilon_cap:g} (it has no privacy.dp_sgd)"
            )
        if self.allowed_reports is not None:
            leaving = set(REPORT_KINDS) - set(policy.privacy.reports.forbidden)
            extra = sorted(leaving - set(self.allowed_reports))
            if extra:
                problems.append(
                    f"allowed_reports: the policy lets {extra} reports leave; this site allows "
                    f"{sorted(self.allowed_reports)} (privacy.reports.forbidden can keep them)"
                )
        model = policy.model
        if isinstance(model, PluginModel) and model.factory not in self.allowed_model_factories:
            problems.append(
                f"allowed_model_factories: the policy's model factory {model.factory!r} is not in "
                f"{self.allowed_model_factories} (a site runs a plugin model only once its "
                "silo.yaml lists it under rules.allowed_model_factories)"
            )
        if self.forbid_data_releases and policy.algorithm.releases_data:
            problems.append(
                f"forbid_data_releases: {policy.algorithm.name} sends point clouds built from "
                "this site's records, a data-like release this site forbids"
            )
        return problems


SOURCE_KEY = "data.source"  # where silo.yaml holds the data section's keys


class SiloData(PolicyModel):
    """This silo's data: a data section, and which of its silos is this one.

    For a real site the section points at the site's own file (csv, npz), which is one silo
    unless `data.source.partition` says otherwise; `select` names the silo when the section
    describes several (the bundled demo data, simulations).
    """

    source: DataConfig
    select: str | None = None

    def site_source(self) -> DataConfig:
        """The data section as this site reads it: a file with no partition is one silo."""
        if self.source.source in SITE_SOURCES and self.source.partition is None:
            return self.source.model_copy(update={"partition": IidPartition(kind="iid", silos=1)})
        return self.source

    def load(self, seed: int, base_dir: Path | None) -> SiloDataset:
        """This silo's dataset; a DataError names the silo.yaml key to change."""
        try:
            datasets = load_consortium(self.site_source(), seed, base_dir=base_dir)
        except DataError as error:
            raise error.within(SOURCE_KEY) from None
        names = [d.name for d in datasets]
        if self.select is None:
            if len(datasets) != 1:
                raise DataError(
                    f"the data section yields silos {names}; set data.select to the one this "
                    f"site is (or, for a site's own file, remove {SOURCE_KEY}.partition: the "
                    "file is then one silo)"
                )
            return datasets[0]
        if self.select not in names:
            raise DataError(
                f"data.select: no silo {self.select!r}; the data section yields {names}"
            )
        return datasets[names.index(self.select)]


class CoordinatorLink(PolicyModel):
    """How this silo reaches the coordinator: `proxy`, an HTTP CONNECT proxy's URL
    (http://host:port) that takes precedence over https_proxy, or `direct`; None: the
    environment decides, as gRPC reads it (silo/proxy.py)."""

    proxy: str | None = None

    @field_validator("proxy")
    @classmethod
    def _proxy_url(cls, value: str | None) -> str | None:
        if value is None or value == DIRECT:
            return value
        try:
            return check_proxy_url(value)
        except ValueError as exc:
            raise ValueError(f"{exc}, or {DIRECT!r} to connect directly") from None


class SiloConfig(PolicyModel):
    version: int = Field(default=1, ge=1, le=1)
    kit: str
    coordinator: CoordinatorLink = CoordinatorLink()
    data: SiloData
    compute: ComputeConfig | None = None  # overrides the policy's placement at this site
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    rules: LocalRules = LocalRules()
    ledger: str = "privacy-ledger.jsonl"  # this site's privacy ledger, beside this file
    state: str = "silo-state"  # what outlives the agent (SuPerFed's local models), beside it

    def kit_path(self, config_file: Path) -> Path:
        return (config_file.parent / self.kit).resolve()

    def ledger_path(self, config_file: Path) -> Path:
        return (config_file.parent / self.ledger).resolve()

    def state_path(self, config_file: Path) -> Path:
        return (config_file.parent / self.state).resolve()


def load_silo_config(path: Path) -> SiloConfig:
    document = read_yaml(read_text_file(path, "silo configuration"), str(path))
    return parse_silo_config(document, str(path))


def parse_silo_config(document: Any, source: str) -> SiloConfig:
    """A validated silo configuration, or a PolicyError naming `source` and each field."""
    try:
        return SiloConfig.model_validate(document)
    except ValidationError as exc:
        raise PolicyError(describe_errors(exc, document, source)) from None
