// A real OpenID Connect provider (panva's oidc-provider, OpenID Certified) on loopback,
// for the sign-in tests: one confidential client, one test user with a password, PKCE
// required, consent granted on the user's behalf.
//
//   OIDC_PROVIDER_HOME=<dir with node_modules/oidc-provider> PORT=<port> \
//   OIDC_CLIENT_ID=... OIDC_CLIENT_SECRET=... OIDC_REDIRECT_URI=... node tests/oidc/provider.mjs
//
// Prints "listening <issuer>" once it accepts connections.
import { generateKeyPairSync } from "node:crypto";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const home = process.env.OIDC_PROVIDER_HOME;
const pkgDir = join(home, "node_modules", "oidc-provider");
const main = JSON.parse(readFileSync(join(pkgDir, "package.json"), "utf8")).main || "lib/index.js";
const { default: Provider } = await import(pathToFileURL(join(pkgDir, main)).href);

const port = Number(process.env.PORT);
const issuer = `http://127.0.0.1:${port}`;

export const USER = {
  login: process.env.OIDC_USER_LOGIN || "alice",
  password: process.env.OIDC_USER_PASSWORD || "wonderland-password",
  sub: process.env.OIDC_USER_SUB || "alice-sub",
  email: process.env.OIDC_USER_EMAIL || "alice@example.test",
  name: process.env.OIDC_USER_NAME || "Alice Liddell",
};

const signingKey = generateKeyPairSync("rsa", { modulusLength: 2048 }).privateKey.export({ format: "jwk" });

const provider = new Provider(issuer, {
  clients: [
    {
      client_id: process.env.OIDC_CLIENT_ID,
      client_secret: process.env.OIDC_CLIENT_SECRET,
      redirect_uris: [process.env.OIDC_REDIRECT_URI],
      grant_types: ["authorization_code"],
      response_types: ["code"],
      token_endpoint_auth_method: "client_secret_basic",
    },
  ],
  jwks: { keys: [{ ...signingKey, kid: "test-signing-key", use: "sig", alg: "RS256" }] },
  cookies: { keys: ["a test cookie key, nothing secret"] },
  claims: { openid: ["sub"], email: ["email", "email_verified"], profile: ["name"] },
  pkce: { required: () => true },
  features: { devInteractions: { enabled: false } },
  interactions: { url: (ctx, interaction) => `/interaction/${interaction.uid}` },
  async findAccount(ctx, sub) {
    if (sub !== USER.sub) return undefined;
    return {
      accountId: sub,
      async claims() {
        return { sub, email: USER.email, email_verified: true, name: USER.name };
      },
    };
  },
});

const page = (uid, error = "") => `<!doctype html><meta charset="utf-8"><title>Test provider sign-in</title>
<h1>Test identity provider</h1>${error ? `<p id="error">${error}</p>` : ""}
<form method="post" action="/interaction/${uid}">
  <label>Login <input id="login" name="login" autocomplete="username"></label>
  <label>Password <input id="password" name="password" type="password" autocomplete="current-password"></label>
  <button id="submit" type="submit">Sign in</button>
</form>`;

async function readForm(req) {
  let body = "";
  for await (const chunk of req) body += chunk;
  return new URLSearchParams(body);
}

provider.use(async (ctx, next) => {
  const match = /^\/interaction\/([^/]+)$/.exec(ctx.path);
  if (!match) return next();
  const details = await provider.interactionDetails(ctx.req, ctx.res);
  const { prompt, params, session } = details;
  if (prompt.name === "consent") {
    // this provider's one user consents to what the client asked for
    const grant = new provider.Grant({ accountId: session.accountId, clientId: params.client_id });
    if (prompt.details.missingOIDCScope) grant.addOIDCScope(prompt.details.missingOIDCScope.join(" "));
    if (prompt.details.missingOIDCClaims) grant.addOIDCClaims(prompt.details.missingOIDCClaims);
    const grantId = await grant.save();
    return provider.interactionFinished(ctx.req, ctx.res, { consent: { grantId } }, { mergeWithLastSubmission: true });
  }
  if (ctx.method === "GET") {
    ctx.type = "html";
    ctx.body = page(details.uid);
    return undefined;
  }
  const form = await readForm(ctx.req);
  if (form.get("login") !== USER.login || form.get("password") !== USER.password) {
    ctx.type = "html";
    ctx.body = page(details.uid, "wrong login or password");
    return undefined;
  }
  return provider.interactionFinished(ctx.req, ctx.res, { login: { accountId: USER.sub } }, { mergeWithLastSubmission: false });
});

provider.listen(port, "127.0.0.1", () => {
  console.log(`listening ${issuer}`);
});
