"""Images and audio through the official clients (issue 46): each API's own way of sending a
picture reaches the server's media checks in that API's terms, and a model without a projector
is a 400 in that API's error shape naming it, before anything is decoded or loaded; the next
request is answered as before."""

from __future__ import annotations

import base64

import pytest
from media_files import data_url, png, wav

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")

NO_PROJECTOR = "has no projector for images"
PNG = base64.b64encode(png()).decode()


def test_openai_chat_image_url_and_input_audio(smollm_server_512):
    client = openai.OpenAI(base_url=smollm_server_512 + "/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="smollm2", max_tokens=2, messages=[
            {"role": "user", "content": [
                {"type": "text", "text": "What is in the picture?"},
                {"type": "image_url", "image_url": {"url": data_url(png()), "detail": "low"}}]}])
    assert "the model 'smollm2' " + NO_PROJECTOR in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="smollm2", max_tokens=2, messages=[
            {"role": "user", "content": [
                {"type": "input_audio", "input_audio": {
                    "data": base64.b64encode(wav()).decode(), "format": "mp3"}}]}])
    assert refused.value.body["message"] == \
        "messages[0].content[0]: the audio is WAV, not mp3"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="smollm2", max_tokens=2, messages=[
            {"role": "user", "content": [
                {"type": "input_audio", "input_audio": {
                    "data": base64.b64encode(wav()).decode(), "format": "wav"}}]}])
    assert "has no projector for audio" in refused.value.body["message"]


def test_responses_input_image(smollm_server_512):
    client = openai.OpenAI(base_url=smollm_server_512 + "/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="smollm2", max_output_tokens=16, input=[
            {"role": "user", "content": [
                {"type": "input_text", "text": "Describe it."},
                {"type": "input_image", "image_url": data_url(png()[:-20]), "detail": "auto"}]}])
    assert refused.value.body["message"] == "input[0].content[1]: the PNG file is truncated " \
                                            "or corrupt"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="smollm2", max_output_tokens=16, input=[
            {"role": "user", "content": [
                {"type": "input_image", "image_url": data_url(png()), "detail": "auto"}]}])
    assert NO_PROJECTOR in refused.value.body["message"]


def test_anthropic_image_blocks(smollm_server_512):
    client = anthropic.Anthropic(base_url=smollm_server_512, api_key="-", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="smollm2", max_tokens=8, messages=[
            {"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": PNG}},
                {"type": "text", "text": "Describe it."}]}])
    assert NO_PROJECTOR in refused.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="smollm2", max_tokens=8, messages=[
            {"role": "user", "content": [
                {"type": "image", "source": {"type": "url",
                                             "url": "https://127.0.0.1:9/cat.png"}}]}])
    assert "--allow-remote-media" in refused.value.body["error"]["message"]


def test_ollama_images_on_chat_and_generate(smollm_server_512):
    client = ollama.Client(host=smollm_server_512)
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model="smollm2", messages=[
            {"role": "user", "content": "Describe it.", "images": [png()]}])   # bytes: sent as base64
    assert refused.value.status_code == 400 and NO_PROJECTOR in refused.value.error
    with pytest.raises(ollama.ResponseError) as refused:
        client.generate(model="smollm2", prompt="Describe it.", images=[b"not an image"])
    assert refused.value.error.startswith("images[0] is not an image or audio file")
    with pytest.raises(ollama.ResponseError) as refused:
        client.generate(model="smollm2", prompt="Describe it.", images=[PNG], raw=True)
    assert "'images' needs the model's chat template, which raw leaves out" in \
        refused.value.error
    shown = client.show("smollm2")
    assert "vision" not in shown.capabilities and "completion" in shown.capabilities
    answer = client.generate(model="smollm2", prompt="Hi", options={"num_predict": 2,
                                                                     "temperature": 0})
    assert answer.response
