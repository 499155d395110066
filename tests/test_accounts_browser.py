"""The web client with accounts, in headless Chromium against the real server: sign-in
through a real OpenID Connect provider, sign-up and sign-in with a password, API keys
in the settings, the admin's users, signing out, and a session that ends elsewhere."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from app.main import create_app
from tests.oidc_provider import LOGIN, NAME, PASSWORD, server_with_oidc
from tests.servers import chromium, serve

DESKTOP = {"width": 1280, "height": 860}


@pytest.fixture(scope="module")
def browser():
    with chromium() as launched:
        yield launched


@pytest.fixture
def new_page(browser):
    """new_page(url): a page of a fresh browser context (its own cookies). No page may
    throw."""
    errors: list[str] = []
    with contextlib.ExitStack() as stack:

        def open_(url):
            context = browser.new_context(viewport=DESKTOP)
            stack.callback(context.close)
            page = context.new_page()
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.base = url
            page.goto(url + "/")
            return page

        yield open_
    assert errors == []


def ask(page, question, nth=0):
    page.select_option("#focus", "deepSeek")
    page.fill("#question", question)
    page.click("#send")
    page.wait_for_selector(
        f".turn[data-state=completed] >> nth={nth}", state="attached", timeout=15_000
    )


def sign_up_on(page, name, email, password="correct horse battery"):
    page.wait_for_selector("#signin:not([hidden])")
    page.click("#signin-toggle")
    page.fill("#signin-name", name)
    page.fill("#signin-email", email)
    page.fill("#signin-password", password)
    page.click("#signin-submit")
    page.wait_for_selector("#signin", state="hidden")


def test_sign_in_through_the_identity_provider_and_ask(new_page, settings, fake_model):
    fake_model.answer_text = "Hello from the fake model."
    with server_with_oidc(settings) as (server, provider):
        page = new_page(server.url)
        page.wait_for_selector("#signin:not([hidden])")
        button = page.locator("#signin-oidc")
        assert button.inner_text() == "Sign in with Test IdP"
        button.click()
        page.wait_for_url(provider.issuer + "/**")
        page.fill("#login", LOGIN)
        page.fill("#password", "not it")
        page.click("#submit")
        page.wait_for_selector("#error")  # the provider's own refusal
        page.fill("#login", LOGIN)
        page.fill("#password", PASSWORD)
        page.click("#submit")
        page.wait_for_url(server.url + "/**")
        page.wait_for_selector("#account:not([hidden])")
        assert page.locator("#signin").is_hidden()
        assert NAME in page.locator("#account-name").inner_text()
        assert page.locator("#open-admin").is_visible()  # the first account
        ask(page, "what is deepseek")
        assert "Hello from the fake model." in page.locator(".turn .answer").inner_text()
        cookies = {c["name"]: c for c in page.context.cookies()}
        assert cookies["sc_session"]["httpOnly"] and cookies["sc_session"]["sameSite"] == "Lax"
        assert "sc_oidc" not in cookies  # the flow's cookie is spent
        assert page.evaluate("document.cookie") == ""  # nothing a script can read


def test_password_accounts_keys_and_the_admin_page(new_page, settings, fake_model):
    fake_model.answer_text = "An answer."
    with serve(create_app(settings.replace(auth={"mode": "accounts"}))) as server:
        admin = new_page(server.url)
        sign_up_on(admin, "Ada", "ada@example.test")
        assert "Ada" in admin.locator("#account-name").inner_text()
        ask(admin, "first question")
        # over the WebSocket too, with the session cookie
        admin.evaluate("() => localStorage.setItem('settings', JSON.stringify({transport: 'ws'}))")
        admin.reload()
        admin.wait_for_selector("#account:not([hidden])")
        assert admin.locator("#signin").is_hidden()  # still signed in after a reload
        ask(admin, "over a socket")

        # API keys in the settings: made, shown once, usable, revoked
        admin.click("#open-settings")
        admin.wait_for_selector("#keys:not([hidden])")
        admin.fill("#key-name", "laptop")
        admin.press("#key-name", "Enter")
        admin.wait_for_selector("#key-new:not([hidden])")
        key = admin.locator("#key-new-value").inner_text()
        assert key.startswith("sck_")
        admin.wait_for_selector("#key-list li[data-key-id]")
        assert "laptop" in admin.locator("#key-list").inner_text()
        assert key not in admin.locator("#key-list").inner_text()  # only its first characters
        assert admin.locator("#settings").is_visible()  # Enter made a key, not closed settings
        bearer = {"authorization": f"Bearer {key}"}
        assert httpx.get(server.url + "/api/chats", headers=bearer).status_code == 200
        admin.click("#key-list li[data-key-id] .revoke")
        admin.wait_for_selector("#key-list li[data-key-id]", state="detached")
        assert httpx.get(server.url + "/api/chats", headers=bearer).status_code == 401
        admin.click("#settings .primary")

        # a second person signs up in another browser
        other = new_page(server.url)
        sign_up_on(other, "Bob", "bob@example.test")
        assert other.locator("#open-admin").is_hidden()
        ask(other, "bob asks")

        # the admin page: users, tokens today, quotas, enabled
        admin.click("#open-admin")
        admin.wait_for_selector("#admin[open] #admin-users tr >> nth=1")
        bob_row = admin.locator("#admin-users tr", has_text="bob@example.test")
        assert int(bob_row.locator(".today").inner_text().replace(",", "")) > 0
        bob_row.locator(".quota").fill("1")
        bob_row.locator(".quota").dispatch_event("change")
        admin.wait_for_function(
            "() => [...document.querySelectorAll('#admin-users tr')].some(r =>"
            " r.innerText.includes('bob@') && r.querySelector('.quota').value === '1')"
        )
        other.fill("#question", "one more")
        other.click("#send")
        other.wait_for_selector(".turn[data-error=RATE_LIMITED]")
        assert "today's share" in other.locator(".turn[data-error] .status").inner_text()
        bob_row = admin.locator("#admin-users tr", has_text="bob@example.test")
        bob_row.locator(".enabled").uncheck()
        admin.wait_for_selector("#admin-users tr.disabled")
        admin.click("#admin .primary")

        # Bob's next request (a new chat lists the chats again) meets the sign-in page
        other.click("#new-chat")
        other.wait_for_selector("#signin:not([hidden])")
        assert "session has ended" in other.locator("#signin-error").inner_text()
        other.fill("#signin-email", "bob@example.test")
        other.fill("#signin-password", "correct horse battery")
        other.click("#signin-submit")
        other.wait_for_function(
            "() => document.querySelector('#signin-error').innerText.includes('disabled')"
        )

        # signing out shows the sign-in page, and the page names no user anywhere
        admin.click("#sign-out")
        admin.wait_for_selector("#signin:not([hidden])")
        assert (
            httpx.get(
                server.url + "/api/chats",
                cookies={c["name"]: c["value"] for c in admin.context.cookies()},
            ).status_code
            == 401
        )


def test_sign_up_by_invitation_on_the_page(new_page, settings, fake_model):
    changes = {"auth": {"mode": "accounts", "signup": "invite"}}
    with serve(create_app(settings.replace(**changes))) as server:
        admin = new_page(server.url)
        sign_up_on(admin, "Ada", "ada@example.test")  # the first needs no invite
        admin.click("#open-admin")
        admin.click("#admin-invite")
        admin.wait_for_selector("#admin-invite-code:not([hidden])")
        code = admin.locator("#admin-invite-code").inner_text()
        guest = new_page(server.url)
        guest.wait_for_selector("#signin:not([hidden])")
        guest.click("#signin-toggle")
        assert guest.locator("#signin-invite-row").is_visible()
        guest.fill("#signin-email", "guest@example.test")
        guest.fill("#signin-password", "correct horse battery")
        guest.click("#signin-submit")
        guest.wait_for_function(
            "() => document.querySelector('#signin-error').innerText.includes('invite')"
        )
        guest.fill("#signin-invite", code)
        guest.click("#signin-submit")
        guest.wait_for_selector("#account:not([hidden])")
        ask(guest, "hello")
        # the admin's invite link opens the sign-up with its code filled in
        admin.click("#admin-invite")
        admin.wait_for_function(
            f"() => document.querySelector('#admin-invite-code').innerText !== {code!r}"
        )
        second = admin.locator("#admin-invite-code").inner_text()
        link = admin.locator("#admin-invite-link").get_attribute("href")
        assert link == f"{server.url}/signin?invite={second}"
        invited = new_page(server.url)
        invited.goto(link)
        invited.wait_for_selector("#signin:not([hidden])")
        assert invited.locator("#signin-invite").input_value() == second
        assert invited.locator("#signin-name-row").is_visible()
        invited.fill("#signin-email", "invited@example.test")
        invited.fill("#signin-password", "correct horse battery")
        invited.click("#signin-submit")
        invited.wait_for_selector("#account:not([hidden])")
