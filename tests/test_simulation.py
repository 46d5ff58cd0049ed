"""Whole consortia in one process: reproducible, and as accurate as the issue promises."""

import torch

from fedsilo.coordinator.engine import RoundEngine
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.simulate import load_silos, simulate
from fedsilo.policies.loading import parse_policy
from fedsilo.silo.agent import SiloAgent


def heart_policy(**overrides):
    return parse_policy(
        {
            "version": 1,
            "rounds": 5,
            "seed": 3,
            "algorithm": {"name": "fedavg"},
            "model": {"name": "mlp", "hidden": [8]},
            **overrides,
        }
    )


def test_the_same_seed_gives_bit_identical_results() -> None:
    policy = heart_policy(algorithm={"name": "fedadam", "client_fraction": 0.75})
    silos = load_silos(policy, None)
    first, second = simulate(policy, silos), simulate(policy, load_silos(policy, None))
    assert first.history.state.model.equal(second.history.state.model)
    assert first.history.final.evaluation == second.history.final.evaluation
    assert [r.phases for r in first.history.records] == [r.phases for r in second.history.records]


def test_another_seed_gives_another_run() -> None:
    policy = heart_policy()
    other = policy.with_overrides(seed=4)
    a = simulate(policy, load_silos(policy, None)).history.state.model
    b = simulate(other, load_silos(other, None)).history.state.model
    assert not a.equal(b)


def test_fedavg_on_breast_cancer_over_five_dirichlet_silos_reaches_093() -> None:
    policy = parse_policy(
        {
            "version": 1,
            "rounds": 30,
            "seed": 0,
            "algorithm": {"name": "fedavg"},
            "model": {"name": "linear"},
            "training": {"epochs": 1, "batch_size": 16, "lr": 0.05},
            "data": {
                "source": "sklearn:breast_cancer",
                "scaling": "federated",
                "partition": {"kind": "dirichlet", "silos": 5, "alpha": 0.5},
            },
        }
    )
    result = simulate(policy, load_silos(policy, None))
    assert result.history.final.summary["accuracy"]["mean"] >= 0.93


def test_central_trains_on_the_pooled_union_and_is_tested_at_every_silo() -> None:
    policy = heart_policy(algorithm={"name": "central"})
    result = simulate(policy, load_silos(policy, None))
    train = result.history.records[0].phases["train"]["answered"]
    assert list(train) == ["pooled"] and train["pooled"]["num_samples"] == sum(
        p.train for p in result.silos
    )
    assert set(result.history.final.evaluation) == {p.name for p in result.silos}


def test_local_keeps_one_model_per_silo() -> None:
    policy = heart_policy(algorithm={"name": "local"})
    result = simulate(policy, load_silos(policy, None))
    models = {k: v for k, v in result.history.state.tensors.items() if k.startswith("model/")}
    assert len(models) == 4
    first, *rest = models.values()
    assert not any(torch.equal(first, other) for other in rest)


def features(agent: SiloAgent) -> dict[str, torch.Tensor]:
    """The splits `agent` standardised with the consortium's scaler."""
    standardised = agent.context.store.features
    assert standardised is not None
    return standardised


def test_federated_scaling_standardises_with_the_pooled_statistics() -> None:
    policy = heart_policy(data={"source": "heart", "scaling": "federated"}, rounds=1)
    silos = load_silos(policy, None)
    agents = {s.name: SiloAgent(s.name, s, policy) for s in silos}
    transport = InProcessTransport({name: agent.handle_bytes for name, agent in agents.items()})
    RoundEngine(make_strategy(policy), transport, policy, list(agents)).run()

    raw = torch.cat([s.x_train for s in silos]).double()
    scaled = torch.cat([features(a)["train"] for a in agents.values()]).double()
    observed = ~torch.isnan(raw)
    count = observed.sum(0)
    mean = torch.where(observed, scaled, 0).sum(0) / count
    var = torch.where(observed, scaled**2, 0).sum(0) / count - mean**2
    assert torch.allclose(mean, torch.zeros_like(mean), atol=1e-5)
    constant = raw.nan_to_num().std(0) == 0
    assert torch.allclose(var[~constant], torch.ones_like(var[~constant]), atol=1e-4)
    switzerland = features(agents["Switzerland"])["train"]
    cholesterol = silos[2].feature_names.index("chol")
    assert torch.isnan(silos[2].x_train[:, cholesterol]).all()  # never measured there...
    assert (switzerland[:, cholesterol] == 0).all()  # ...so it reads as the consortium mean


def test_with_local_scaling_under_label_skew_central_itself_suffers() -> None:
    """Why federated scaling exists: per-silo statistics erase a skewed silo's class signal."""
    base = {
        "version": 1,
        "rounds": 20,
        "algorithm": {"name": "central"},
        "model": {"name": "linear"},
        "training": {"batch_size": 16},
    }
    accuracy = {}
    for scaling in ("local", "federated"):
        policy = parse_policy(
            {
                **base,
                "data": {
                    "source": "sklearn:breast_cancer",
                    "scaling": scaling,
                    "partition": {"kind": "dirichlet", "silos": 5, "alpha": 0.5},
                },
            }
        )
        accuracy[scaling] = simulate(policy, load_silos(policy, None)).history.final.summary[
            "accuracy"
        ]["mean"]
    assert accuracy["federated"] > accuracy["local"] + 0.1
