"""kvcal artifacts: a directory with ``kv_scales.safetensors`` (+ ``report.md``).

Tensor names (float32), the names vLLM / SGLang / compressed-tensors load
(see ``shared/docs/runtime-formats.md``):

* ``model.layers.{i}.self_attn.k_scale`` / ``.v_scale`` — static dequantization multipliers,
  ``x ≈ q * scale``. Shape ``[1]`` (per-tensor), ``[H_kv, 1, 1]`` (per-head) or
  ``[H_kv, 1, D]`` (per-channel; kvcal runtime only).
* optional kvcal-only tensors beside them: ``{k,v}_zero_point`` (asymmetric static, same shape
  as the scale), ``{k,v}_clip_ratio`` ``[H_kv]`` (dynamic formats: calibrated fraction of the
  per-group absmax/min-max range), ``k_mean`` ``[H_kv, 1, D]`` (per-channel key centering).

Metadata: one JSON document stored in the safetensors header under the key ``"kvcal"`` with
``schema_version`` (:data:`SCHEMA_VERSION`). Writing is atomic: everything goes into a temporary
sibling directory which is renamed into place only when complete (:mod:`kvcal.outputs`).

Modules: :mod:`kvcal.artifact.io` (the :class:`Artifact`, writing, loading, hashing),
:mod:`kvcal.artifact.schema` (the metadata schema and content hash), :mod:`kvcal.artifact.validate`
(tensor names, shapes and scale ranges), :mod:`kvcal.artifact.sections` (typed read views of metadata
sections: :func:`engine_section`, the engine's own view of the section it calibrated).
"""

from __future__ import annotations

from kvcal.artifact.io import (
           SCHEMA_VERSION,
           Artifact,
           artifact_sha256,
           check_model_match,
           load_artifact,
           write_artifact,
)
from kvcal.artifact.schema import CONTENT_HASH_KEY, SIDES, content_sha256, validate_metadata_schema
from kvcal.artifact.sections import engine_section
from kvcal.artifact.validate import (
           SCALE_SANITY,
           TENSOR_KINDS,
           is_finite_number,
           validate_scales,
           validate_tensors,
)

# The output-path checks and atomic writers live in kvcal.outputs; kvcal.calibrate and kvcal.recommend
# still import these four from here.
from kvcal.outputs import (
           SCALES_FILE,
           check_output_dir,
           check_output_file,
           write_dir_atomically,
           write_file_atomically,
)

__all__ = ["CONTENT_HASH_KEY", "SCALES_FILE", "SCALE_SANITY", "SCHEMA_VERSION", "SIDES", "TENSOR_KINDS", "Artifact",
           "artifact_sha256", "check_model_match", "check_output_dir", "check_output_file", "content_sha256",
           "is_finite_number", "load_artifact", "validate_metadata_schema", "validate_scales", "validate_tensors",
           "engine_section", "write_artifact", "write_dir_atomically", "write_file_atomically"]
