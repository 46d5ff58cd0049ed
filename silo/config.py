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
data:                           # a policy's data section (policies/data.py), less what only
                                # a simulation uses (partition, label_noise), plus select
  source: csv                   # csv or npz for a site's own file
  path: records.csv
  target: outcome               # the label column
  categorical: {smoker: ["no", "yes"]}  # text columns and their agreed categories
  missing: impute               # or error (the default): impute missing values locally
  missing_values: {chol: [0]}   # values that mean "not measured"
  drop_columns: [patient_id]    # columns that are not features
  split: {train: 0.8, val: 0.1, test: 0.1}
  scaling: local                # local, federated or none
  select: null                  # which silo of a multi-silo source (demo data) this is
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
  allowed_strategy_plugins: []  # strategy plug-ins (algorithm names) this site takes part in
  allowed_training_steps: []    # training steps (module:attr of fedsilo.steps) it trains with
  forbid_data_releases: false   # refuse algorithms that send data-like point clouds (feddro)
ledger: privacy-ledger.jsonl    # this site's privacy ledger
state: silo-state               # what outlives the agent
```

The old nested shape, `data: {source: {source: csv, path: ...}, select: ...}`, still loads
(`SiloData`); docs/how-to/site-data.md shows both. `fedsilo silo check --config silo.yaml`
(ops/silo_check.py) loads the data as the agent will.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import (
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from fedsilo.policies.algorithms.plugins import PluginAlgorithm
from fedsilo.policies.base import PolicyModel, unknown_key_message
from fedsilo.policies.compute import ComputeConfig
from fedsilo.policies.data import (
    SHAPE_GUIDE,
    SIMULATION_ONLY_KEYS,
    SITE_SELECT_KEY,
    SITE_SOURCES,
    DataConfig,
    IidPartition,
)
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
    of group `fedsilo.models`) this site runs; none by default; `allowed_strategy_plugins` and
    `allowed_training_steps`: the strategy plug-ins (algorithm names) and training steps (entry
    point values) whose code this site runs; none by default; `forbid_data_releases`: refuse
    algorithms that send data-like releases (FedDRO's point clouds built from the records).
    """

    # the algorithms (algorithm.name) this site takes part in; a policy with another is refused.
    allowed_algorithms: list[str] | None = None  # null: any algorithm
    # the most rounds a policy may ask of this site; null (the default): no limit
    max_rounds: int | None = Field(default=None, ge=1)
    # true: this site takes part only in DP deployments (privacy.dp_sgd, or client_dp with
    # distributed noise); false (the default): any
    require_dp: bool = False
    # this site's own epsilon budget per job, enforced by its ledger beside the policy's
    # privacy.epsilon_cap (the stricter wins); a job without DP is then refused; null (the default):
    # the policy's cap alone
    epsilon_cap: float | None = Field(default=None, gt=0)
    # this site's epsilon budget over all jobs of the consortium (the jobs' epsilons add up); a job
    # whose plan would pass it is refused; a job without DP spends none; null (the default): no
    # total budget
    total_epsilon_cap: float | None = Field(default=None, gt=0)
    # the kinds of scalar report (counts, losses, metrics) that may leave this site; a policy that
    # lets another leave is refused.
    allowed_reports: list[ReportKind] | None = None  # null: every kind the policy allows
    # the plugin model factories (entry point values module:attr of group fedsilo.models) this site
    # runs; empty (the default): no plugin model
    allowed_model_factories: list[str] = Field(default_factory=list)
    # the strategy plug-ins (algorithm names of entry point group fedsilo.algorithms) this site
    # takes part in; empty (the default): none, whatever is installed
    allowed_strategy_plugins: list[str] = Field(default_factory=list)
    # the training steps (entry point values module:attr of group fedsilo.steps) this site trains
    # with; empty (the default): none, only fedsilo's own step
    allowed_training_steps: list[str] = Field(default_factory=list)
    # true: refuse algorithms that send data-like releases built from this site's records (FedDRO's
    # point clouds); false (the default): allow them when the policy says so
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
        algorithm = policy.algorithm
        if (
            isinstance(algorithm, PluginAlgorithm)
            and algorithm.name not in self.allowed_strategy_plugins
        ):
            problems.append(
                f"allowed_strategy_plugins: the policy's strategy plug-in {algorithm.name!r} is "
                f"not in {self.allowed_strategy_plugins} (a site runs a strategy plug-in's code "
                "only once its silo.yaml lists it under rules.allowed_strategy_plugins)"
            )
        step = policy.training.step
        if step is not None and step.plugin not in self.allowed_training_steps:
            problems.append(
                f"allowed_training_steps: the policy's training step {step.plugin!r} is not in "
                f"{self.allowed_training_steps} (a site trains with a step plug-in only once its "
                "silo.yaml lists it under rules.allowed_training_steps)"
            )
        if self.forbid_data_releases and policy.algorithm.releases_data:
            problems.append(
                f"forbid_data_releases: {policy.algorithm.name} sends point clouds built from "
                "this site's records, a data-like release this site forbids"
            )
        return problems


NESTED_KEY = "data.source"  # where silo.yaml's old nested shape holds the data section's keys
# The keys of a site's data section: a policy's, less what only a simulation uses, plus select.
SITE_KEYS = [
    *(key for key in DataConfig.model_fields if key not in SIMULATION_ONLY_KEYS),
    SITE_SELECT_KEY,
]


class SiloData(PolicyModel):
    """This silo's data: a data section, and which of its silos is this one.

    silo.yaml writes it as a policy writes its `data:` section, less the keys only a simulation
    uses (`partition`, `label_noise`), plus `select`: `data: {source: csv, path: ..., select: ...}`.
    For a real site the section points at the site's own file (csv, npz), which is one silo;
    `select` names the silo when the section describes several (the bundled demo data).

    The old nested shape, `data: {source: {source: csv, ...}, select: ...}`, still loads to
    the same section; it alone holds a whole simulated section (a partition, label noise), as
    the deployment tests write it.
    """

    # the data section's keys, written directly under data as a policy writes them (the old shape
    # nests them under data.source)
    source: DataConfig
    # which silo of a multi-silo source this site is (e.g. a hospital of the bundled heart data);
    # null (the default): the section is one silo, as a site's own file is
    select: str | None = None
    _nested: bool = PrivateAttr(default=True)

    @model_validator(mode="wrap")
    @classmethod
    def _either_shape(cls, data: Any, handler: ModelWrapValidatorHandler[SiloData]) -> SiloData:
        """The flat shape validated as a policy's data section; the nested one as written."""
        if not isinstance(data, dict) or isinstance(data.get("source"), dict | DataConfig):
            return handler(data)
        section = {key: value for key, value in data.items() if key != SITE_SELECT_KEY}
        for key in section:
            if key in SIMULATION_ONLY_KEYS:
                raise ValueError(
                    f"field '{key}' is a simulation's ({SIMULATION_ONLY_KEYS[key]}); a site's "
                    f"data is its own, one silo: drop it. silo.yaml's data section is a "
                    f"policy's without {' and '.join(SIMULATION_ONLY_KEYS)}, plus "
                    f"{SITE_SELECT_KEY} ({SHAPE_GUIDE})"
                )
            if key not in SITE_KEYS:
                raise ValueError(unknown_key_message(str(key), SITE_KEYS))
        site = handler(
            {
                "source": DataConfig.model_validate(section),
                SITE_SELECT_KEY: data.get(SITE_SELECT_KEY),
            }
        )
        site._nested = False
        return site

    @property
    def section_key(self) -> str:
        """Where silo.yaml holds the data section's keys: `data`, or `data.source` (nested)."""
        return NESTED_KEY if self._nested else "data"

    def shape_note(self) -> str | None:
        """A note for the old nested shape when the flat one says the same, else None."""
        if not self._nested or any(getattr(self.source, key) for key in SIMULATION_ONLY_KEYS):
            return None
        return (
            f"{NESTED_KEY} holds a nested data section, silo.yaml's old shape; it still loads, "
            "but write its keys directly under data:, as a policy does (data: {source: csv, "
            f"path: ...}}; {SHAPE_GUIDE})"
        )

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
            raise error.within(self.section_key) from None
        names = [d.name for d in datasets]
        if self.select is None:
            if len(datasets) != 1:
                whole = (
                    f" (or, for a site's own file, remove {self.section_key}.partition: the "
                    "file is then one silo)"
                    if self.source.partition is not None
                    else ""
                )
                raise DataError(
                    f"the data section yields silos {names}; set data.select to the one this "
                    f"site is{whole}"
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

    # an HTTP CONNECT proxy's URL (http://host:port) that this silo reaches the coordinator through
    # (mutual TLS runs through it), or direct to bypass any proxy; null (the default): the
    # https_proxy and no_proxy environment variables decide
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
    """A site's silo.yaml. `train_rows_multiple`: the site trains on its training rows rounded
    down to a multiple of this (the rows left out drawn by each job's seed), so the training-set
    size that DP-SGD's sample rate and epsilon reveal (docs/privacy.md) is known only to that
    multiple."""

    # the version of silo.yaml's format; 1, the only one
    version: int = Field(default=1, ge=1, le=1)
    # the folder of this silo's kit (its certificates and the consortium's files, from `fedsilo
    # provision`), relative to silo.yaml's folder (required)
    kit: str
    # how this silo reaches its coordinator (through a proxy, or directly)
    coordinator: CoordinatorLink = CoordinatorLink()
    # this site's data: a policy's data section, less the keys only a simulation uses (partition,
    # label_noise), plus select; written flat under data
    data: SiloData
    # the site trains on its training rows rounded down to a multiple of this (the rows left out
    # drawn by each job's seed), so the training-set size that DP-SGD's sample rate and epsilon
    # reveal is known only to that multiple; null (the default): every training row
    train_rows_multiple: int | None = Field(default=None, ge=2)
    # this site's compute section (its device), which overrides the policy's placement at this
    # site; null (the default): the policy's compute section applies
    compute: ComputeConfig | None = None
    # the port on 127.0.0.1 where the agent serves Prometheus metrics; null (the default): no
    # metrics endpoint
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    # what this site allows: a policy that breaks a rule is refused when the silo joins, with the
    # rule named
    rules: LocalRules = LocalRules()
    # the file of this site's privacy ledger, where every release of its data is booked with its
    # epsilon (privacy-ledger.jsonl beside silo.yaml by default)
    ledger: str = "privacy-ledger.jsonl"
    # the folder of what outlives the agent between rounds and restarts (e.g. SuPerFed's local
    # models), silo-state beside silo.yaml by default
    state: str = "silo-state"

    def kit_path(self, config_file: Path) -> Path:
        return (config_file.parent / self.kit).resolve()

    def load_data(self, config_file: Path, seed: int) -> SiloDataset:
        """This site's dataset for a job of `seed`, as its agent trains on it (its training
        rows to `train_rows_multiple`); a DataError names the silo.yaml key."""
        data = self.data.load(seed, base_dir=config_file.parent)
        if self.train_rows_multiple is None:
            return data
        return data.with_train_rows_multiple_of(self.train_rows_multiple, seed)

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
