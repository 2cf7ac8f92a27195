"""The locally trained demo target/draft pair (stdlib-trained tiny Llamas) and its cost-matched twins.

Call `ensure_demo_pair()`; see `build.py`. Nothing heavy is imported until a build actually runs.
"""

from .build import DemoPair, ensure_demo_pair

__all__ = ["DemoPair", "ensure_demo_pair"]
