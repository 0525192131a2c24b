"""Shared by the megatron_tir test folders: this folder is on sys.path (pytest puts a
conftest's folder there), so ``from scripted_engine import ScriptedEngine`` works in the
rollout and eval tests alike."""
