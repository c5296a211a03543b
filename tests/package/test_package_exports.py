"""The public surface: facades re-export, and the package imports without its optional extras."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types

import pytest

import trio_rl

FACADES = [
    "trio_rl",
    "trio_rl.samples",
    "trio_rl.payloads",
    "trio_rl.wire",
    "trio_rl.policy",
    "trio_rl.engines",
    "trio_rl.rollout",
    "trio_rl.envs",
    "trio_rl.sink",
    "trio_rl.publish",
    "trio_rl.transport",
    "trio_rl.trainer",
    "trio_rl.testing",
    "trio_rl.evals",
    "trio_rl.orchestrator",
    "trio_rl.workers",
    "trio_rl.learn",  # imports torch (the optional extra); nothing else imports it
]


@pytest.mark.parametrize("name", FACADES)
def test_every_public_name_resolves_and_is_documented(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__doc__, f"{name} has no module docstring"
    public = [n for n in vars(module) if not n.startswith("_")]
    assert public, f"{name} exports nothing"
    for n in public:
        assert getattr(module, n) is not None


def test_the_top_level_facade_defines_nothing_itself() -> None:
    defined_here = [
        n
        for n, v in vars(trio_rl).items()
        if not n.startswith("_") and getattr(v, "__module__", None) == "trio_rl"
    ]
    assert defined_here == []


def test_importing_the_library_does_not_import_torch() -> None:
    code = "import sys, trio_rl, trio_rl.trainer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_transport_facade_exports_one_sender_and_one_receiver_per_transport() -> None:
    import trio_rl.transport as transport

    public = {n for n in vars(transport) if not n.startswith("_")}
    assert public == {
        "Sender",
        "Receiver",
        "Payload",
        "ReceivedPayload",
        "FileSender",
        "FileReceiver",
        "ZmqSender",
        "ZmqReceiver",
        "MemorySender",
        "MemoryReceiver",
        "ZmqSocket",
        "StagingSender",
        "batch_path",
        "step_topic",
        "rank_topic",
        "free_port_pair",
        "TransportError",
        "TransportIOError",
        "TransportTimeoutError",
        "EndOfStreamError",
        # transports by name: the registry every transport registers in
        "TransportKind",
        "TransportSetup",
        "register_transport",
        "unregister_transport",
        "transport_kind",
        "transport_kinds",
        # the file transport's layout, which the run directory and `trio-rl inspect` read
        "held_steps",
        "batches_dir",
        "end_marker_path",
        "consumed_dir",
        "STEP_DIR",
        "RANK_FILE",
        "CONSUMED_FILE",
    }
    for sender in (transport.FileSender, transport.ZmqSender, transport.MemorySender):
        assert issubclass(sender, transport.Sender)
    for receiver in (transport.FileReceiver, transport.ZmqReceiver, transport.MemoryReceiver):
        assert issubclass(receiver, transport.Receiver)


def _public(module_name: str) -> set[str]:
    return {n for n in vars(importlib.import_module(module_name)) if not n.startswith("_")}


# What a user of each layer needs: the classes and functions they call, the types that appear in
# a public signature (return types, callback types they implement, parameter aliases) and the
# layer's errors. Internals (event types of the credit channel, per-sample helpers of scoring,
# the checkpoint schema number) stay in their private modules.
PINNED: dict[str, set[str]] = {
    "trio_rl.envs": {
        *("CallSyntax", "ChatTemplate", "Codec", "CompactCalls", "EPISODE_KEY", "EnvConfig"),
        *("EnvConfigError", "EnvError", "EnvFn", "Episode", "EpisodeRunner", "EpisodeStats"),
        *("EpisodeStoppedError", "HermesCalls", "Message", "MismatchPolicy", "RecordRewardFn"),
        *("STOP_REASONS", "StopReason", "TemplateMismatchError", "ToolCall"),
        *("ToolCallSyntaxError", "ToolEnv", "ToolRewardFn", "import_env", "single_turn"),
    },
    "trio_rl.rollout": {
        *("AsyncDriverStatistics", "AsyncRolloutDriver", "CreditError", "CreditLedger"),
        *("CreditScheduler", "CreditView", "DataSource", "DataSourceError", "DiscardHook"),
        *("DiscardReason", "DriverFailedError", "DriverFailedError", "DynamicFilter"),
        *(
            "FailureBudgetExceededError",
            "FailureBudgetExceededError",
            "FailurePolicy",
            "GenerateFn",
        ),
        *("GroupDone", "GroupFactory", "GroupFailedError", "GroupFailedError", "GroupGranularity"),
        *("GroupOutcome", "GroupRewardFn", "GroupRunner", "GroupStatus", "InMemorySource"),
        *("JsonlSource", "RolloutBatch", "RolloutConfigError", "RolloutError", "SampleBackfill"),
        *("SampleDone", "SampleRewardFn", "SchedulerStatistics", "SourceExhaustedError"),
        *("SourceExhaustedError", "SubmissionPolicy", "SyncBatchStatistics", "SyncRolloutDriver"),
        *("UnusedPolicy", "engine_generate", "open_async_rollout", "pending_samples"),
        *("prompt_to_dict", "reject_aborted", "run_group", "run_reporting"),
        *("RoutingKeys", "SeedRule", "RolloutConfig"),
        *("RecordReward", "RecordRewardFn", "import_reward", "read_records"),
        # the soft stop a custom generate function (an episode's turns) hands its engine
        "current_abort",
        # a sample reward running in a worker of its own gives its sample's credit back
        "reward_started",
        # a record reward in killable workers of its own, and how a record is named
        *("describe_record", "open_record_reward"),
        # staleness-aware admission: open_async_rollout's parameter, AsyncRolloutDriver.expiry
        *("Admission", "Expiry"),
        # the priority lane an eval shares a driver's credits through (and the policy wrapper
        # a scheduler's ``policy`` is while one is attached)
        *("PriorityLane", "LanePolicy", "LaneStatistics"),
    },
    "trio_rl.workers": {
        *("DEFAULT_WORKERS", "WORKER_MODES", "WorkerMode", "WorkerPool", "open_worker_pool"),
        *("WorkerCallError", "WorkerDiedError", "WorkerError", "WorkerStartError"),
        "WorkerTimeoutError",
    },
    "trio_rl.sink": {
        *("Checkpoint", "CheckpointCompactionError", "CheckpointConfig", "CheckpointError"),
        "CheckpointManager",
        "CheckpointSnapshot",
        *("CodecError", "Cut", "DetachedBatch", "IncrementalSnapshot", "PayloadError"),
        "PayloadFileMissingError",
        *("PayloadFileMissingError", "PruneMode", "PruneResult", "RestoreReport"),
        *("ScoringConfig", "SequenceLists", "SinkConfig", "SinkCounters", "SinkState"),
        *("SinkWindow", "TrainBatch", "TrainError", "TrainSink", "TrainSinkError"),
        *("TrainingSample", "build_sequences", "copy_sample", "decode_checkpoint"),
        *("encode_checkpoint", "grpo_advantages", "prune_detached", "prune_zero_advantages"),
        *("read_checkpoint", "to_training_sample", "write_checkpoint"),
        # the staleness rule's allowed values and default, defined once for every config
        *("DEFAULT_STALENESS", "STALENESS_RULES", "StalenessRule"),
        # a checkpoint checked against the run that restores it
        *("RunBounds", "check_run_bounds"),
        # TrainSink.zero_output: #3806's zero-output budget
        "ZeroOutputBudget",
    },
    "trio_rl.publish": {
        *("AttemptStats", "BatchSource", "Checkpointer", "CohortStats", "DeferredRelease"),
        *("Distribution", "Encoder", "Monitor", "MonitorTimeoutError", "Packer", "PackingError"),
        *("PublishError", "Publisher", "ReleaseTimeoutError", "ShipRecord", "ShipTimings"),
        *("Shipment", "SinkCheckpointer", "cohort_stats", "malloc_trim", "open_publisher"),
        *("pack_samples", "release_containers"),
        # the types of ShipRecord's fields, and the lazy packer the publisher streams from
        *("Annotation", "PackedRank", "SelectionStats", "ShipWarning", "ThreadStats"),
        *("WarningKind", "pack_lazily", "step_record"),
        # the run's totals a checkpoint keeps (open_publisher's progress=)
        "ProgressTotals",
    },
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_a_layer_facade_exports_what_a_user_needs_and_no_internals(name: str) -> None:
    public = _public(name)
    assert public - PINNED[name] == set(), f"{name} exports internals"
    assert PINNED[name] - public == set(), f"{name} lost public names"


def test_the_top_level_facade_leaves_the_transport_protocols_to_trio_rl_transport() -> None:
    # next to BatchReceiver, a bare `trio_rl.Receiver` reads as the trainer's receiver
    assert {"Sender", "Receiver"} & _public("trio_rl") == set()
    assert {"Sender", "Receiver"} <= _public("trio_rl.transport")


def test_every_top_level_name_is_the_same_object_as_in_its_layer() -> None:
    layers = [f for f in FACADES if f not in ("trio_rl", "trio_rl.learn")] + ["trio_rl.errors"]
    for n in _public("trio_rl") - {"__version__"}:
        value = getattr(trio_rl, n)
        if isinstance(value, types.ModuleType):
            continue  # the layer subpackages themselves
        owners = [m for m in layers if getattr(importlib.import_module(m), n, None) is value]
        assert owners, f"trio_rl.{n} is not exported by any layer facade"
