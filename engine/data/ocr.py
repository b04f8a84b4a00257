"""PaddleOCR-VL training samples: its chat template's prompt form, and every record checked by line and field.

The published template (``engine/assets/paddleocr_vl_chat_template.jinja``) differs from ERNIE 4.5 VL's in
two ways the encoder follows: an image is ``<|IMAGE_START|>`` + one ``<|IMAGE_PLACEHOLDER|>`` per decoder token
+ ``<|IMAGE_END|>`` with no ``Picture N:`` before it, and an assistant turn ends with the tokenizer's eos
(``</s>``, the token generation stops at), not ``<|end_of_sentence|>``. Image token counts come from the
PaddleOCR-VL image processor (``paddleocr_vl_processor.image_grid``, from the file's header).

A record PaddleOCR-VL cannot learn from is an error naming its line and field, never a sample quietly
skipped: no image, a video, an image that does not decode, text that does not fit ``max_seq_len`` after
the image tokens. The record checks themselves (paths confined to the dataset directory, the pixel limit)
are ``formats``'; ``loader.check_ocr_file`` reads a whole file as a run does.
"""

from __future__ import annotations

from engine.data.encode import EncodedSample, SampleEncoder, turn_samples
from engine.data.paddleocr_vl_processor import OCRProcessorSettings, image_grid
from engine.data.record_types import IMAGE_MARK, Conversation, Example, RecordError, Turn, VideoClip
from engine.tokenizer import IMAGE_END, IMAGE_PLACEHOLDER, IMAGE_START, ErnieTokenizer


class OCRSampleEncoder(SampleEncoder):
    """``SampleEncoder`` with PaddleOCR-VL's prompt form; ``encode`` raises ``RecordError`` for unusable records."""

    # every image is decoded when its record is read (a truncated file fails there, naming its field)
    decode_images = True

    def __init__(
        self,
        tokenizer: ErnieTokenizer,
        max_seq_len: int,
        settings: OCRProcessorSettings | None = None,
        max_prompt_len: int | None = None,
    ):
        super().__init__(tokenizer, max_seq_len, None, max_prompt_len)
        self.vision = settings or OCRProcessorSettings()

    def media_tokens(self, item) -> int:
        if item not in self._media_tokens:
            _, h, w = image_grid(item, self.vision)
            self._media_tokens[item] = h * w // self.vision.merge_size**2
        return self._media_tokens[item]

    def expand_media(self, text: str, media: list, first_picture: int = 1, first_video: int = 1) -> str:
        pieces = text.split(IMAGE_MARK)
        out = [pieces[0]]
        for item, rest in zip(media, pieces[1:], strict=True):
            out += [IMAGE_START + IMAGE_PLACEHOLDER * self.media_tokens(item) + IMAGE_END, rest]
        return "".join(out)

    def reply_ids(self, turn: Turn) -> list[int]:
        # the eos id itself: its piece ("</s>") written as text would be encoded as plain characters
        return [*self.tok.encode(turn.assistant), self.tok.eos_token_id]

    def encode(self, example: Example) -> list[EncodedSample]:
        if not isinstance(example, Conversation):
            raise RecordError(
                ["PaddleOCR-VL trains on image + text records (OCR pairs or ERNIEKit VL records)"]
            )
        media = [m for turn in example.turns for m in turn.media]
        if not media:
            raise RecordError(
                [
                    "the record has no image: PaddleOCR-VL learns to read images; give it one (image_info or image)"
                ]
            )
        if any(isinstance(m, VideoClip) for m in media):
            raise RecordError(["video_info: PaddleOCR-VL reads images only; give the frames as images"])
        out = []
        for conv in turn_samples(example):
            sample = self.encode_conversation(conv)
            if sample is None:
                raise RecordError([self._too_long(conv)])
            out.append(sample)
        return out

    def _too_long(self, conv: Conversation) -> str:
        """Why ``conv`` gives no sample: its tokens against max_seq_len, naming the answer's field."""
        image = sum(self.media_tokens(m) for t in conv.turns for m in t.media)
        total = len(self.tok.encode(self.head_text(conv.system)))
        for t in conv.turns:
            total += len(self.tok.encode(self.prompt_text(t))) + len(self.reply_ids(t))
        field = f"field '{conv.turns[-1].answer_field}'" if conv.turns[-1].answer_field else "the answer"
        if total <= self.max_seq_len:  # fits, yet nothing to learn (every turn untrained)
            return f"{field}: no answer in the record is trained"
        return (
            f"{field}: text longer than max_seq_len after the image tokens: the sample takes {total} tokens "
            f"({image} of them the image's), over max_seq_len={self.max_seq_len}; raise max_seq_len, lower "
            "max_pixels (fewer image tokens) or split the text"
        )
