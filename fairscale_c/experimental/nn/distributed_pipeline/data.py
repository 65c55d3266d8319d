"""Who consumes an output: a consumer, which of its inputs, which of the producer's outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

ConsumerType = TypeVar("ConsumerType")


@dataclass
class DataConsumer(Generic[ConsumerType]):
    consumer: ConsumerType
    consumer_input_idx: int  # which input of the consumer
    output_idx: int  # which output of the producer (or which model input)
