"""OrtEngine's thread-pool options reach the ONNX Runtime session."""
import pytest

from specrt.engines import EngineError
from specrt.engines.ort import DEFAULT_SPIN_US, OrtEngine


def entry(engine, key):
    return engine.session.get_session_options().get_session_config_entry(key)


def test_default_spin_is_bounded_and_the_others_reach_the_session(llama_engine):
    path = llama_engine / "target.onnx"
    assert entry(OrtEngine(path), "session.intra_op.spin_duration_us") == str(DEFAULT_SPIN_US)
    assert entry(OrtEngine(path, spinning=500), "session.intra_op.spin_duration_us") == "500"
    assert entry(OrtEngine(path, spinning=False), "session.intra_op.allow_spinning") == "0"
    assert entry(OrtEngine(path, spinning=True), "session.intra_op.allow_spinning") == "1"
    assert entry(OrtEngine(path, spinning="run"), "session.force_spinning_stop") == "1"
    assert OrtEngine(path, threads=1).session.get_session_options().intra_op_num_threads == 1
    with pytest.raises(EngineError, match="microseconds"):
        OrtEngine(path, spinning=-5)
