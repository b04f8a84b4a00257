"""Datasets for training: ERNIEKit formats, validation, encoding with the chat template, packing, mixing."""

from engine.data.encode import IGNORE_INDEX, EncodedPair, EncodedSample, SampleEncoder, render_record
from engine.data.formats import detect_format, parse_record
from engine.data.loader import DatasetSource, DataSpec, TrainData, build_train_data, parse_spec
from engine.data.packing import collate_packed, collate_padded, non_pad_share, pack_sequences
from engine.data.record_types import FORMATS, KINDS, RecordError
from engine.data.records import Page, read_page
from engine.data.stats import dataset_stats
from engine.data.validate import DatasetError, Problem, ValidationReport, validate_file

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "KINDS",
    "DataSpec",
    "DatasetError",
    "DatasetSource",
    "EncodedPair",
    "EncodedSample",
    "Page",
    "Problem",
    "RecordError",
    "SampleEncoder",
    "TrainData",
    "ValidationReport",
    "build_train_data",
    "collate_packed",
    "collate_padded",
    "dataset_stats",
    "detect_format",
    "non_pad_share",
    "pack_sequences",
    "parse_record",
    "parse_spec",
    "read_page",
    "render_record",
    "validate_file",
]
