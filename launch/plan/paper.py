"""Renamed to launch.plan.published (the comparison now covers verl and NeMo-RL too); kept for old imports."""

from launch.plan.published import PUBLISHED, RECIPE_PUBLISHED, against_published, render_cases

against_paper = against_published

__all__ = ["PUBLISHED", "RECIPE_PUBLISHED", "against_paper", "against_published", "render_cases"]
