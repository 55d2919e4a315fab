#!/usr/bin/env bash
# Build the image of deploy/Dockerfile and push it to Amazon ECR, tagged with the package version and with the
# git commit it was built from; print the commit-tagged URI and the line that sets VISIONRL_IMAGE, which the
# Slurm launcher (deploy/slurm/ray_cluster.sh) and the KubeRay job (deploy/kuberay/rayjob.yaml) read.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: deploy/push_image.sh [--region REGION] [--repository NAME] [--dry-run]

Builds deploy/Dockerfile once and pushes it to Amazon ECR as
  ACCOUNT.dkr.ecr.REGION.amazonaws.com/NAME:VERSION   (version in pyproject.toml)
  ACCOUNT.dkr.ecr.REGION.amazonaws.com/NAME:COMMIT    (git rev-parse --short HEAD; -dirty with local changes)
creating the repository (scan on push) if it does not exist yet. Ends with the commit-tagged URI and
  export VISIONRL_IMAGE=URI
which you can paste, or run: eval "$(deploy/push_image.sh | tail -n 1)"

  --region REGION     AWS region of the registry (default: $AWS_REGION, then $AWS_DEFAULT_REGION)
  --repository NAME   ECR repository (default: $VISIONRL_ECR_REPOSITORY, then visionrl)
  --dry-run           print the commands without running any of them (the account shows as ACCOUNT)
  -h, --help          this help

Needs the AWS CLI (v2), credentials for the account (aws configure, aws sso login or AWS_PROFILE) and docker.
The account comes from `aws sts get-caller-identity`. On an arm64 machine, build for the GPU instances with
DOCKER_DEFAULT_PLATFORM=linux/amd64.
EOF
}

die() {
  echo "error: $*" >&2
  exit 2
}

region=${AWS_REGION:-${AWS_DEFAULT_REGION:-}}
repository=${VISIONRL_ECR_REPOSITORY:-visionrl}
dry_run=0
while (($# > 0)); do
  case $1 in
    --region) [[ $# -ge 2 ]] || die "--region needs a value, e.g. --region us-east-1"; region=$2; shift 2 ;;
    --region=*) region=${1#*=}; shift ;;
    --repository) [[ $# -ge 2 ]] || die "--repository needs a value, e.g. visionrl"; repository=$2; shift 2 ;;
    --repository=*) repository=${1#*=}; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see deploy/push_image.sh --help)" ;;
  esac
done
[[ -n $region ]] || die "no AWS region: pass --region REGION (e.g. us-east-1) or set AWS_REGION"
[[ -n $repository ]] || die "--repository is empty: name the ECR repository, e.g. --repository visionrl"

# The build context is the repository root, wherever this is run from.
cd "$(dirname "${BASH_SOURCE[0]}")/.."

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)
[[ -n $version ]] || die "no 'version = \"...\"' line in $(pwd)/pyproject.toml: the image is tagged with it"
commit=$(git rev-parse --short HEAD 2>/dev/null) ||
  die "$(pwd) is not a git checkout with a commit: the image is tagged with the commit it was built from"
# A tag that names a commit must say when the build holds more than that commit.
if [[ -n $(git status --porcelain) ]]; then
  commit="$commit-dirty"
  echo "warning: the working tree has uncommitted changes: the image is tagged $commit" >&2
fi

# Show a command (--dry-run) or run it.
run() {
  if ((dry_run)); then
    printf '+'
    printf ' %q' "$@"
    printf '\n'
  else
    "$@"
  fi
}

if ((dry_run)); then
  account=ACCOUNT
  run aws sts get-caller-identity --query Account --output text
else
  command -v aws >/dev/null || die "the AWS CLI (aws) is not on PATH: install AWS CLI v2," \
    "https://docs.aws.amazon.com/cli/latest/userguide/getting-started-install.html"
  command -v docker >/dev/null ||
    die "docker is not on PATH: install Docker, https://docs.docker.com/engine/install/"
  docker info >/dev/null 2>&1 ||
    die "docker cannot reach its daemon (docker info failed): start Docker, or use a docker-group user"
  account=$(aws sts get-caller-identity --query Account --output text) ||
    die "not logged in to AWS (aws sts get-caller-identity failed, see above):" \
      "run 'aws configure' or 'aws sso login', or set AWS_PROFILE to a profile that is"
fi
registry="$account.dkr.ecr.$region.amazonaws.com"
image="$registry/$repository"

# The repository, once: scan each pushed image for known vulnerabilities.
if ((dry_run)); then
  run aws ecr describe-repositories --repository-names "$repository" --region "$region"
  echo "# if it does not exist:"
  run aws ecr create-repository --repository-name "$repository" \
    --image-scanning-configuration scanOnPush=true --region "$region"
elif ! aws ecr describe-repositories --repository-names "$repository" --region "$region" >/dev/null 2>&1; then
  echo "creating the ECR repository $repository in $region" >&2
  aws ecr create-repository --repository-name "$repository" --image-scanning-configuration scanOnPush=true \
    --region "$region" >/dev/null
fi

# Docker logs in with a token valid for 12 hours; the password goes through a pipe, never a command line.
if ((dry_run)); then
  echo "+ aws ecr get-login-password --region $region |" \
    "docker login --username AWS --password-stdin $registry"
else
  aws ecr get-login-password --region "$region" | docker login --username AWS --password-stdin "$registry"
fi

# One build, two tags: the version for people, the commit for exactly what runs.
run docker build -f deploy/Dockerfile -t "$image:$version" -t "$image:$commit" .
run docker push "$image:$version"
run docker push "$image:$commit"

echo "$image:$commit"
echo "export VISIONRL_IMAGE=$image:$commit"
