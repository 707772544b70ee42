"""Engines behind one async interface: in-process vLLM, OpenAI-compatible servers, a simulator."""

from .base import Chunk, Engine, EngineMonitor, EngineUnreachable, Generation, PrefixCacheStats
from .costmodel import BUILTIN_PROFILES, CostModel, load_cost_model
from .eventsim import EventSimEngine
from .openai_engine import OpenAIEngine

__all__ = [
    "BUILTIN_PROFILES",
    "Chunk",
    "CostModel",
    "Engine",
    "EngineMonitor",
    "EngineUnreachable",
    "EventSimEngine",
    "Generation",
    "OpenAIEngine",
    "PrefixCacheStats",
    "load_cost_model",
]
