"""Engines behind one async interface: in-process vLLM, OpenAI-compatible servers, a simulator."""

from .base import Chunk, Engine, EngineMonitor, Generation, PrefixCacheStats
from .costmodel import BUILTIN_PROFILES, CostModel, load_cost_model
from .openai_engine import EngineUnreachable, OpenAIEngine
from .sim import SimEngine

__all__ = [
    "BUILTIN_PROFILES",
    "Chunk",
    "CostModel",
    "Engine",
    "EngineMonitor",
    "EngineUnreachable",
    "Generation",
    "OpenAIEngine",
    "PrefixCacheStats",
    "SimEngine",
    "load_cost_model",
]
