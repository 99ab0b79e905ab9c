// A real OpenID Connect provider for loraplex's SSO tests: the `oidc-provider` package with its
// development sign-in form (any password; the login names an account below) and consent given
// ahead for the one static client. Started by tests/utils/oidc.py:
//   node provider.js '<json: {"port": 0, "redirect_uris": [...], "client_id": ..., "client_secret": ...}>'
// It prints one line `ready <issuer>` once it listens. Test data only: nothing here is a secret.
import http from 'node:http';
import Provider from 'oidc-provider';

const config = JSON.parse(process.argv[2]);

// Each account's claims; `groups` carries the roles loraplex maps (see docs/sso.md).
const ACCOUNTS = {
  alice: { name: 'Alice Operator', email: 'alice@example.test', groups: ['lpx-operators', 'staff'] },
  bob: { name: 'Bob Viewer', email: 'bob@example.test', groups: ['lpx-viewers'] },
  carol: { name: 'Carol Nobody', email: 'carol@example.test', groups: ['staff'] },
};

async function findAccount(ctx, id) {
  const account = ACCOUNTS[id];
  if (!account) return undefined;
  return {
    accountId: id,
    async claims() {
      return { sub: id, preferred_username: id, ...account };
    },
  };
}

const server = http.createServer();
server.listen(config.port || 0, '127.0.0.1', () => {
  const issuer = `http://127.0.0.1:${server.address().port}`;
  const provider = new Provider(issuer, {
    clients: [{
      client_id: config.client_id,
      client_secret: config.client_secret,
      redirect_uris: config.redirect_uris,
      grant_types: ['authorization_code'],
      response_types: ['code'],
      token_endpoint_auth_method: 'client_secret_basic',
    }],
    findAccount,
    claims: {
      openid: ['sub'],
      profile: ['name', 'preferred_username'],
      email: ['email'],
      groups: ['groups'],
    },
    scopes: ['openid', 'profile', 'email', 'groups'],
    pkce: { required: () => true },
    features: { devInteractions: { enabled: true } },
    cookies: { keys: ['loraplex-test-only-cookie-key'] },
    // Consent is given ahead for the static client: the sign-in form is the only interaction.
    async loadExistingGrant(ctx) {
      const grantId = ctx.oidc.result?.consent?.grantId
        || ctx.oidc.session.grantIdFor(ctx.oidc.client.clientId);
      if (grantId) return ctx.oidc.provider.Grant.find(grantId);
      const grant = new ctx.oidc.provider.Grant({
        clientId: ctx.oidc.client.clientId,
        accountId: ctx.oidc.session.accountId,
      });
      grant.addOIDCScope('openid profile email groups');
      await grant.save();
      return grant;
    },
  });
  provider.proxy = false;
  server.on('request', provider.callback());
  process.stdout.write(`ready ${issuer}\n`);
});

process.on('SIGTERM', () => server.close(() => process.exit(0)));
