from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OfferRequest(_message.Message):
    __slots__ = ("run_id", "side", "rank", "contract", "claimed_hash", "settings")
    class SettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SIDE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_HASH_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    side: str
    rank: int
    contract: bytes
    claimed_hash: str
    settings: _containers.ScalarMap[str, str]
    def __init__(self, run_id: _Optional[str] = ..., side: _Optional[str] = ..., rank: _Optional[int] = ..., contract: _Optional[bytes] = ..., claimed_hash: _Optional[str] = ..., settings: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ParticipantHash(_message.Message):
    __slots__ = ("side", "rank", "contract_hash", "settings")
    class SettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SIDE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_HASH_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    side: str
    rank: int
    contract_hash: str
    settings: _containers.ScalarMap[str, str]
    def __init__(self, side: _Optional[str] = ..., rank: _Optional[int] = ..., contract_hash: _Optional[str] = ..., settings: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("outcome", "run_id", "generation", "contract_hash", "participants", "summary", "diff")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OUTCOME_UNSPECIFIED: _ClassVar[Verdict.Outcome]
        MATCH: _ClassVar[Verdict.Outcome]
        MISMATCH: _ClassVar[Verdict.Outcome]
    OUTCOME_UNSPECIFIED: Verdict.Outcome
    MATCH: Verdict.Outcome
    MISMATCH: Verdict.Outcome
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_HASH_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    DIFF_FIELD_NUMBER: _ClassVar[int]
    outcome: Verdict.Outcome
    run_id: str
    generation: int
    contract_hash: str
    participants: _containers.RepeatedCompositeFieldContainer[ParticipantHash]
    summary: str
    diff: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, outcome: _Optional[_Union[Verdict.Outcome, str]] = ..., run_id: _Optional[str] = ..., generation: _Optional[int] = ..., contract_hash: _Optional[str] = ..., participants: _Optional[_Iterable[_Union[ParticipantHash, _Mapping]]] = ..., summary: _Optional[str] = ..., diff: _Optional[_Iterable[str]] = ...) -> None: ...

class QueryRequest(_message.Message):
    __slots__ = ("run_id", "side", "rank")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SIDE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    side: str
    rank: int
    def __init__(self, run_id: _Optional[str] = ..., side: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class QueryReply(_message.Message):
    __slots__ = ("may_receive_weights", "reason")
    MAY_RECEIVE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    may_receive_weights: bool
    reason: str
    def __init__(self, may_receive_weights: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class CanaryRequest(_message.Message):
    __slots__ = ("run_id", "side", "rank", "weights_version", "logprobs")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SIDE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    side: str
    rank: int
    weights_version: int
    logprobs: bytes
    def __init__(self, run_id: _Optional[str] = ..., side: _Optional[str] = ..., rank: _Optional[int] = ..., weights_version: _Optional[int] = ..., logprobs: _Optional[bytes] = ...) -> None: ...

class CanaryVerdict(_message.Message):
    __slots__ = ("outcome", "run_id", "weights_version", "reference", "first_position", "summary")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    outcome: Verdict.Outcome
    run_id: str
    weights_version: int
    reference: str
    first_position: int
    summary: str
    def __init__(self, outcome: _Optional[_Union[Verdict.Outcome, str]] = ..., run_id: _Optional[str] = ..., weights_version: _Optional[int] = ..., reference: _Optional[str] = ..., first_position: _Optional[int] = ..., summary: _Optional[str] = ...) -> None: ...
