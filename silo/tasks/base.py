"""What every task handler gets: the silo's own data, how to build its model, where to run it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, TypeVar

import torch
from nacl.public import PrivateKey, PublicKey
from nacl.signing import SigningKey, VerifyKey
from torch import nn

from fedsilo.models.zoo import build_model, load_flat
from fedsilo.policies.algorithms.base import AlgorithmBase
from fedsilo.policies.algorithms.contract import SiloContract, SiloFacts
from fedsilo.policies.model import ModelConfig, PluginModel
from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.policies.schema import Policy
from fedsilo.policies.secure_aggregation import SecureAggregationConfig
from fedsilo.privacy.accounting import Mechanism
from fedsilo.privacy.lineage import digest_entry, task_digest_of, tensor_digest, wrapped_config
from fedsilo.silo.data import SiloDataset
from fedsilo.silo.local_parameters import KEPT, as_received, local_names, own_values, use_own
from fedsilo.silo.memory import SiloMemory
from fedsilo.silo.reports import Reports
from fedsilo.silo.state import LocalState
from fedsilo.wire.messages import SIMULATION, TaskMessage, TaskResult
from fedsilo.wire.payload import digest_of
from fedsilo.wire.tasks import EncryptedInput, MaskedInput, TaskConfig
from fedsilo.wire.tasks.tensor_names import MODEL
from fedsilo.wire.tensors import ParameterSpec, TensorsOnDemand, WireError, all_finite, read_only

Config = TypeVar("Config", bound=TaskConfig)


@dataclass(frozen=True)
class SiloKeys:
    """A silo's identity and what it holds of the consortium's members, as provisioning gave
    them: `identity` signs its masking keys, receipts and hand-offs, `roster` (every member's
    verify key) checks its peers', `sealing_key` opens what members seal to it (CKKS keys,
    hand-offs) and `sealing_roster` holds every member's public sealing key."""

    identity: SigningKey | None = field(default=None, repr=False)
    roster: Mapping[str, VerifyKey] = field(default_factory=dict)
    sealing_key: PrivateKey | None = field(default=None, repr=False)
    sealing_roster: Mapping[str, PublicKey] = field(default_factory=dict)


@dataclass(frozen=True)
class SiloContext:
    """What every handler gets: the silo's data, its own copy of the policy (every setting it
    uses comes from there, never from a task), where it runs, what it keeps, its keys."""

    name: str
    data: SiloDataset
    policy: Policy  # the silo's own copy of the signed policy
    device: torch.device
    store: SiloMemory = field(default_factory=SiloMemory)  # what it keeps between tasks
    state: LocalState = field(default_factory=LocalState)  # what outlives the process (disk)
    secret: bytes = b""  # key material only this silo holds: it seeds every noise draw
    deployment: str = SIMULATION
    job: str = ""  # the digest of the signed policy the silo accepted ("": none pinned)
    keys: SiloKeys = SiloKeys()

    @property
    def model_config(self) -> ModelConfig:
        return self.policy.model

    @property
    def privacy(self) -> PrivacyConfig:
        return self.policy.privacy

    @property
    def rounds(self) -> int:
        """The deployment's rounds: DP-SGD calibrates its noise over all of them."""
        return self.policy.rounds

    def job_noise(self) -> float | None:
        """DP-SGD's noise multiplier under the policy's `privacy.job_epsilon`: calibrated once
        per job over this silo's whole plan (silo/budget_plan.py); None without it."""
        if self.privacy.job_epsilon is None or self.privacy.dp_sgd is None:
            return None
        return self._job_noise

    @cached_property
    def _job_noise(self) -> float:
        from fedsilo.silo.budget_plan import calibrated_job_noise

        return calibrated_job_noise(self)

    @cached_property
    def secure_aggregation(self) -> SecureAggregationConfig:
        """The policy's section as the silo enforces it (`Policy.silo_secure_aggregation`: no
        sum over fewer silos than min_silos or min_group, whichever is larger)."""
        return self.policy.silo_secure_aggregation

    @property
    def algorithm(self) -> AlgorithmBase:
        return self.policy.algorithm

    @cached_property
    def contract(self) -> SiloContract:
        """What its algorithm asks of it (policies/algorithms/contract.py), and nothing else."""
        return self.policy.algorithm.silo_contract(self.policy)

    @cached_property
    def facts(self) -> SiloFacts:
        """What the contract is checked with: the members, the silo's model's layout (built
        once), its data's schema."""
        return SiloFacts(
            name=self.name,
            members=tuple(sorted(self.roster)),
            sealing_keys={n: bytes(k).hex() for n, k in self.sealing_roster.items()},
            spec=parameter_spec(self.new_model(seed=0)),
            input_shape=tuple(self.data.input_shape),
            classes=self.data.num_classes or 0,
        )

    @property
    def consortium(self) -> int:
        """Silos in the deployment, as this silo knows it (bounds a round's)."""
        return max(1, len(self.roster))

    @property
    def identity(self) -> SigningKey | None:
        return self.keys.identity

    @property
    def roster(self) -> Mapping[str, VerifyKey]:
        return self.keys.roster

    @property
    def sealing_key(self) -> PrivateKey | None:
        return self.keys.sealing_key

    @property
    def sealing_roster(self) -> Mapping[str, PublicKey]:
        return self.keys.sealing_roster

    def private_seed(self, task_id: str, purpose: str) -> int:
        """A seed for one task's noise (DP-SGD's noise and Poisson draws, noisy reports): from
        the silo's secret, the job and the task, so a run repeats bit for bit while the
        coordinator, which chose the task and its seed, cannot predict the noise and subtract
        it. A task id is answered once per job (the agent's answer store), and another job
        (another signed policy, even with the same task ids) draws other noise."""
        key = json.dumps([self.job, task_id, purpose]).encode()
        digest = hashlib.blake2b(key, key=self.secret[:64], digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1

    def noise_generator(self, task_id: str, purpose: str) -> torch.Generator:
        return torch.Generator().manual_seed(self.private_seed(task_id, purpose))

    def reports(self, task_id: str, split: str) -> Reports:
        """The reports of one task on `split` (its count's noise fixed per split and job)."""
        return Reports(
            self.privacy,
            self.noise_generator(task_id, "reports"),
            self.noise_generator("deployment", f"count/{split}"),
        )

    def unreleased_counts(self, split: str) -> int:
        """1 while `split`'s sample count has not left this silo yet, else 0 (see reports.py)."""
        return 0 if split in self.store.released_counts else 1

    def released_count(self, split: str) -> None:
        self.store.released_counts.add(split)

    def new_model(self, seed: int) -> nn.Module:
        return build_model(self.model_config, self.data.input_shape, self.data.output_dim, seed).to(
            self.device
        )

    def load_model(self, message: TaskMessage) -> tuple[nn.Module, ParameterSpec]:
        """The model the task carries, on this silo's device; refuses a model of another shape.
        A zoo network is the silo's kept one, refilled (silo/model_skeleton.py): one per task."""
        if MODEL not in message.tensors or message.spec is None:
            raise WireError(f"{message.kind} task carries no model")
        model = (
            self.new_model(seed=0)
            if isinstance(self.model_config, PluginModel)
            else self.store.skeleton.take(lambda: self.new_model(seed=0))
        )
        spec = parameter_spec(model)
        if spec != message.spec:
            raise WireError(
                "the model sent does not fit this silo's model (policy or data schema differ)"
            )
        load_flat(model, read_only(message.tensors, MODEL))
        own = local_names(self.algorithm.local_parameters(), model)
        use_own(model, own, self.state.latest(KEPT, message.round) if own else None)
        return model, spec

    def keep_local(
        self, message: TaskMessage, model: nn.Module, spec: ParameterSpec, trained: torch.Tensor
    ) -> torch.Tensor:
        """After training `model` (whose flat parameters are `trained`): keep the values of the
        parameters this silo's algorithm keeps local, and give `trained` back with the values
        received in their place (silo/local_parameters.py)."""
        own = local_names(self.algorithm.local_parameters(), model)
        if not own:
            return trained
        self.state.save(KEPT, message.round, own_values(model, own))
        return as_received(trained, read_only(message.tensors, MODEL), spec, own)

    def split(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Features (standardised with the consortium's scaler once received) and labels."""
        features = self.store.features
        x = features[name] if features is not None else self.raw_split(name)
        if bool(torch.isnan(x).any()):
            raise ValueError(
                "features still hold missing values: with data.scaling 'federated' the "
                "consortium's scaler must arrive before training"
            )
        return x.to(self.device), getattr(self.data, f"y_{name}").to(self.device)

    def raw_split(self, name: str) -> torch.Tensor:
        if name not in ("train", "val", "test"):
            raise ValueError(f"unknown split {name!r}; use train, val or test")
        return getattr(self.data, f"x_{name}")


def parameter_spec(model: nn.Module) -> ParameterSpec:
    return ParameterSpec.of(dict(model.named_parameters()))


def flat_parameters(model: nn.Module, spec: ParameterSpec) -> torch.Tensor:
    return spec.flatten(dict(model.named_parameters()))


def config_of(message: TaskMessage, cls: type[Config]) -> Config:
    """`message`'s config as the `cls` its handler reads."""
    if not isinstance(message.config, cls):
        raise WireError(f"a {message.kind} task is no {cls.KIND} task")
    return message.config


def inner_message(message: TaskMessage) -> TaskMessage:
    """The task a secure-aggregation step wraps (its `inner` config), with the step's model
    and ids: the silo runs it as if it had come alone."""
    config = message.config
    if not isinstance(config, MaskedInput | EncryptedInput):
        raise WireError(f"a {message.kind} task wraps no task")
    return replace(message, config=config.inner)


def model_digest(model: torch.Tensor) -> bytes:
    """A flat model's digest (dtype, length and bytes): what names a daisy chain's root."""
    flat = model.detach().to("cpu").contiguous().reshape(-1)
    header = f"{str(flat.dtype).removeprefix('torch.')}|{flat.numel()}|".encode()
    return digest_of([header, memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else b""])


def task_digest(message: TaskMessage) -> bytes:
    """What every silo of one secure sum must have received alike, digested: the task its
    masked or encrypted input wraps (less `PER_SILO_KEYS`, which differ by design), its
    parameter spec and every tensor sent (the model, the sum's references), each by its digest
    (privacy/lineage.py `task_digest_of`, which a silo checking a model's lineage recomputes
    from the digests alone). Each silo signs it into its consistency statement or
    contribution, so a coordinator that sends the silos of one sum different models or
    settings (Pasquini et al. 2022, model inconsistency) gets no share revealed and no sum
    decrypted."""
    config = message.config
    if not isinstance(config, MaskedInput | EncryptedInput):
        raise WireError(f"a {message.kind} task wraps no task")
    return task_digest_of(
        config.inner.KIND,
        wrapped_config(config.inner),
        message.spec.to_json() if message.spec is not None else None,
        {
            name: digest_entry(read_only(message.tensors, name), digest)
            for name, digest in tensor_digests(message.tensors).items()
        },
    )


def tensor_digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
    """Every tensor's `tensor_digest` (privacy/lineage.py): a received message's computed
    once, whoever asks (the task's digest, model lineage's checks), and kept with it
    (`TensorsOnDemand.digests`); another mapping's each time."""
    kept = tensors.digests if isinstance(tensors, TensorsOnDemand) else {}
    for name in tensors:
        if name not in kept:
            kept[name] = tensor_digest(read_only(tensors, name))
    return {name: kept[name] for name in tensors}


def new_session(
    ctx: SiloContext, protocol: str, aggregation: str, keep: Collection[str] = ()
) -> dict[str, Any]:
    """A fresh store for one aggregation of `protocol` (its `session_key`); older ones are
    dropped (one aggregation at a time, so an older one can no longer be finished), except
    those `keep` names (masking's keys advertised ahead for a later aggregation)."""
    sessions = ctx.store.sessions.setdefault(protocol, {})
    for key in [k for k in sessions if k not in keep]:
        del sessions[key]
    sessions[aggregation] = {}
    return sessions[aggregation]


def find_session(
    ctx: SiloContext, protocol: str, message: TaskMessage, needs: str
) -> dict[str, Any] | None:
    """This aggregation's store if it holds `needs`, else None (a step out of order)."""
    session = ctx.store.sessions.get(protocol, {}).get(session_id(message))
    return session if session is not None and needs in session else None


def session_id(message: TaskMessage) -> str:
    return session_key(message.round, message.phase)


def session_key(round_no: int, phase: str) -> str:
    """The key of the aggregation of `phase` in round `round_no` among a silo's sessions."""
    return f"r{round_no}/{phase}"


def task_result(
    message: TaskMessage,
    ctx: SiloContext,
    tensors: dict[str, torch.Tensor],
    num_samples: int = 0,
    metrics: dict[str, float] | None = None,
    spec: ParameterSpec | None = None,
) -> TaskResult:
    """The answer to `message`: `tensors` (a model's in `spec`'s layout), the count released
    and the metrics reported (protocol steps send tensors only). The tensors belong to the
    answer alone, never memory the silo keeps and writes again: the answer leaves as views of
    them (`SiloAgent.handle_bytes`; tests/test_answer_ownership.py)."""
    return TaskResult(
        task_id=message.task_id,
        silo=ctx.name,
        kind=message.kind,
        num_samples=num_samples,
        metrics=metrics or {},
        tensors=tensors,
        spec=spec,
    )


def summable(result: TaskResult, names: Iterable[str]) -> TaskResult:
    """A wrapped task's `result`, once its tensors `names` are finite: a secure sum cannot
    leave out a non-finite value the way the coordinator drops one sent in the clear, and an
    encoding would turn it into garbage that no one could see in the sum."""
    for name in names:
        if not all_finite(result.tensors[name]):
            raise ValueError(
                f"the trained {name!r} is not finite, so it enters no sum: a training that "
                "diverged (a smaller training.lr or other optimizer settings may help)"
            )
    return result


def protocol_answer(
    message: TaskMessage, ctx: SiloContext, tensors: dict[str, torch.Tensor]
) -> TaskResult:
    """The answer to `message`, a step of a secure sum or a hand-off, whose model or update
    leaves masked, encrypted or sealed: `tensors`, and nothing beside them. The wrapped
    training's reports (its loss, steps, DP-SGD's parameters, its count) stay at the silo: a
    loss beside a masked input is the loss of a model the coordinator chose, on the silo's
    rows (`TaskResult` refuses an answer of such a kind that carries one)."""
    return TaskResult(task_id=message.task_id, silo=ctx.name, kind=message.kind, tensors=tensors)


TaskHandler = Callable[[TaskMessage, SiloContext], TaskResult]
# What a task would release, known before it runs: the silo checks its budget against it.
ReleasePlan = Callable[[TaskMessage, SiloContext], list[Mechanism]]
# What a task leaves in the silo's state that a later task's releases read, without running it.
StatePlan = Callable[[TaskMessage, SiloContext], None]


def leaves_nothing(message: TaskMessage, ctx: SiloContext) -> None:
    """A task whose run no later release depends on."""


@dataclass(frozen=True)
class TaskKind:
    """Everything the silo knows of one task kind, registered once (silo/tasks/__init__.py):
    what runs it and what it releases (booked in the ledger and checked against the budget
    before it runs); what it sends, checked against the policy's secure aggregation, is the
    kind's own on the wire (its config's `SENDS`, wire/tasks/release.py). `leaves`: what a run
    leaves that later releases depend on, for the privacy planner (silo/budget_plan.py), which
    plans a job without running it."""

    handler: TaskHandler
    releases: ReleasePlan
    leaves: StatePlan = leaves_nothing
